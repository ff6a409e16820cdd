package startup_test

import (
	"context"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestFreshInstallUsesThePartitionInterval: the worker started on an empty
// database with partitions of an hour, three ahead, migrates it and lays
// outbox_event's partitions on the hour, without anyone dropping the
// migration's day-long ones by hand: the first event lands in a partition
// an hour long. The relay reports how far the partitions reach, 3 to 4
// hours, and the configured interval, so WorkerOutboxPartitionsRunningOut
// (reach / interval < 1.5) stays quiet.
func TestFreshInstallUsesThePartitionInterval(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t) // the worker migrates it at start
	ctx := context.Background()
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_TASKS_ENABLED=false",
		"APP_OUTBOX_PARTITION_INTERVAL=1h", "APP_OUTBOX_PARTITIONS_AHEAD=3", "APP_OUTBOX_METRICS_INTERVAL=100ms"})
	p.waitReady(t, 60*time.Second)
	testkit.Eventually(t, 30*time.Second, "the partitions laid on the hour", atMostEvery(50*time.Millisecond, func() bool {
		var n int
		var hourly bool
		if err := db.Pool.QueryRow(ctx, `SELECT count(*), coalesce(bool_and(hi - lo = interval '1 hour'), false)
			FROM outbox_partition`).Scan(&n, &hourly); err != nil {
			t.Fatal(err)
		}
		return n >= 3 && hourly
	}))
	var length time.Duration
	if err := db.Pool.QueryRow(ctx, `WITH e AS (
			INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', '1', 'order.created', '{}') RETURNING created_at)
		SELECT (extract(epoch FROM p.hi - p.lo) * 1e9)::bigint FROM e JOIN outbox_partition p ON e.created_at >= p.lo AND e.created_at < p.hi`).
		Scan(&length); err != nil {
		t.Fatal(err)
	}
	if length != time.Hour {
		t.Errorf("the first event landed in a partition %s long, want 1h", length)
	}
	var ahead, interval float64
	testkit.Eventually(t, 10*time.Second, "the relay to report the partitions' reach", atMostEvery(50*time.Millisecond, func() bool {
		_, body := p.get("/metrics")
		a, okA := sample(body, "outbox_partitions_ahead_seconds")
		i, okI := sample(body, "outbox_partition_interval_seconds")
		ahead, interval = a, i
		return okA && okI && a > 0
	}))
	t.Logf("outbox_partitions_ahead_seconds %.0f, outbox_partition_interval_seconds %.0f", ahead, interval)
	if interval != 3600 || ahead < 3*3600-60 || ahead > 4*3600 || ahead/interval < 1.5 {
		t.Errorf("partitions reach %.0f s past now with an interval of %.0f s; want 3 to 4 hours, an interval of 3600, and a ratio of at least 1.5 (the alert's)",
			ahead, interval)
	}
}
