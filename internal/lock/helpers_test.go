package lock

import (
	"context"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/testkit"

	"github.com/prometheus/client_golang/prometheus"
)

// metered wraps l with metrics on a fresh registry.
func metered(t *testing.T, l Locker) (Locker, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := WithMetrics(l, reg)
	if err != nil {
		t.Fatal(err)
	}
	return m, reg
}

// metricValue reads one series from reg: a counter or gauge value, or a
// histogram's sample count. labels are name, value pairs.
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	v, ok := testkit.Metric(t, reg, name, want)
	// The decorator's series also carry the provider, whichever it is.
	for _, p := range []string{"inprocess", "postgres", "redis"} {
		if ok {
			break
		}
		want["provider"] = p
		v, ok = testkit.Metric(t, reg, name, want)
	}
	if !ok {
		t.Fatalf("metric %s%v not found", name, labels)
	}
	return v
}

// waitClosed fails the test if ch is not closed within d.
func waitClosed(t *testing.T, ch <-chan struct{}, d time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(d):
		t.Fatalf("%s did not happen within %s", what, d)
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}
