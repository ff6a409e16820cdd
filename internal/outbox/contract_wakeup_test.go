package outbox_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestContractWakeUpByNotify: with a poll interval of an hour only the
// insert trigger's NOTIFY can wake the relay, so an event published within a
// second proves the wake-up path. Several events, one after the other, show
// it keeps working after the first.
func TestContractWakeUpByNotify(t *testing.T) {
	const bound = time.Second
	db := pgtest.New(t)
	rec := newContractRecordingSink(nil)
	cfg := contractConfig()
	cfg.PollInterval = time.Hour
	contractStartRelay(t, db.Pool, rec, cfg, "relay", nil, prometheus.NewRegistry())

	var worst time.Duration
	for i := range 5 {
		id := contractAppend(t, db.Pool, fmt.Sprintf("agg-%d", i%2), "order.updated")
		inserted := time.Now()
		testkit.Eventually(t, bound, fmt.Sprintf("event %d published without polling", i), func() bool {
			return rec.deliveredCount(id) == 1
		})
		at, _ := rec.deliveredAt(id)
		worst = max(worst, at.Sub(inserted))
	}
	t.Logf("worst insert-to-publish latency %s", worst)
}
