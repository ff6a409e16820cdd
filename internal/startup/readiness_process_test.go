package startup_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/testkit"
)

// assertReadyThroughSinkOutage waits until the worker's metrics show that
// the relay met the sink's outage (a failed publish, or the sink marked
// down), then asserts /readyz still answers 200: readiness is the worker's
// own, the same for every sink, so a broker outage never turns replicas
// NotReady.
func assertReadyThroughSinkOutage(t *testing.T, p *proc) {
	t.Helper()
	testkit.Eventually(t, 30*time.Second, "the relay to meet the sink's outage", func() bool {
		_, body := p.get("/metrics")
		return sinkOutageSeen(body)
	})
	if code, body := p.get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz during the sink's outage = %d %q, want 200: the sink is not part of readiness", code, body)
	}
	if _, body := p.get("/metrics"); !strings.Contains(body, "\nworker_ready 1\n") {
		t.Error("worker_ready is not 1 during the sink's outage")
	}
}

// sinkOutageSeen reads a scrape for a failed publish or a sink marked down.
func sinkOutageSeen(metrics string) bool {
	for line := range strings.SplitSeq(metrics, "\n") {
		switch {
		case strings.HasPrefix(line, "outbox_sink_up{") && strings.HasSuffix(line, " 0"):
			return true
		case strings.HasPrefix(line, "outbox_publish_failures_total{") && !strings.HasSuffix(line, " 0"):
			return true
		}
	}
	return false
}
