package lock

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/testkit"
)

// flakyStore is a provider whose store answers or not, as the test says:
// an outage of a real store is the process test's
// (TestLockProviderOutageIsLoudAndRecovers); this one pins the timing.
type flakyStore struct {
	InProcess
	down atomic.Bool
}

func (f *flakyStore) Provider() string { return "redis" }

func (f *flakyStore) Ping(context.Context) error {
	if f.down.Load() {
		return errors.New("dial tcp 127.0.0.1:6379: connect: connection refused")
	}
	return nil
}

// A store that stops answering is reported once it has been silent for
// downAfter, not before, with one ERROR line however many pings fail, and
// once it answers again with one INFO line; the gauge follows.
func TestHealthReportsAnOutageOnce(t *testing.T) {
	t.Parallel()
	var logs testkit.LogBuffer
	reg := prometheus.NewRegistry()
	store := &flakyStore{}
	const downAfter = 500 * time.Millisecond
	h, err := NewHealth(store, downAfter, reg, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	gauge := func() float64 { return metricValue(t, reg, "lock_provider_up", "provider", "redis") }
	if err := h.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Shutdown(context.Background()) })
	if !h.Up() || gauge() != 1 {
		t.Fatalf("up=%v gauge=%v before any outage", h.Up(), gauge())
	}

	store.down.Store(true)
	stopped := time.Now()
	testkit.Eventually(t, 5*time.Second, "the outage to be reported", func() bool { return !h.Up() })
	if took := time.Since(stopped); took < downAfter {
		t.Errorf("reported down %s after the store stopped, before downAfter (%s)", took, downAfter)
	}
	if ok, why := h.Ready(); ok || !strings.Contains(why, "lock provider redis unreachable") {
		t.Errorf("Ready() = %v, %q during the outage", ok, why)
	}
	if gauge() != 0 {
		t.Errorf("lock_provider_up = %v during the outage, want 0", gauge())
	}
	// Several more failed pings (one every downAfter/10).
	time.Sleep(3 * downAfter)
	store.down.Store(false)
	testkit.Eventually(t, 5*time.Second, "the recovery to be reported", h.Up)
	if gauge() != 1 {
		t.Errorf("lock_provider_up = %v after the outage, want 1", gauge())
	}
	errs := logs.Lines(t, "lock provider unreachable for longer than the lease ttl; no job runs until it answers")
	if len(errs) != 1 || errs[0]["level"] != "ERROR" || errs[0]["error.code"] != "LOCK_PROVIDER_UNAVAILABLE" {
		t.Errorf("outage lines %v, want one ERROR with error.code LOCK_PROVIDER_UNAVAILABLE", errs)
	}
	if infos := logs.Lines(t, "lock provider reachable again; jobs run again"); len(infos) != 1 || infos[0]["level"] != "INFO" {
		t.Errorf("recovery lines %v, want one INFO", infos)
	}
}

// The in-process provider has no store to lose: always up, no pings.
func TestHealthInProcessIsAlwaysUp(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	h, err := NewHealth(NewInProcess("a", nil), time.Second, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := h.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v := metricValue(t, reg, "lock_provider_up", "provider", "inprocess"); v != 1 || !h.Up() {
		t.Errorf("lock_provider_up = %v, up = %v; want 1, true", v, h.Up())
	}
}
