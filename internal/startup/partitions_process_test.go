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
// (reach / interval < 1.5) stays quiet. Before this, the migration's two
// days covered about 43 hours, the keeper created nothing, and the count of
// partitions ahead read 1, which paged.
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
	// The gauges refresh every metrics_interval, or less often while their
	// query is slow: the first samples may still show the migration's
	// partitions.
	var ahead, interval float64
	reach := func() bool {
		return interval == 3600 && ahead >= 3*3600-60 && ahead <= 4*3600 && ahead/interval >= 1.5
	}
	testkit.Eventually(t, 30*time.Second, "the relay to report the partitions' reach", atMostEvery(50*time.Millisecond, func() bool {
		_, body := p.get("/metrics")
		ahead, _ = sample(body, "outbox_partitions_ahead_seconds")
		interval, _ = sample(body, "outbox_partition_interval_seconds")
		return reach()
	}))
	t.Logf("outbox_partitions_ahead_seconds %.0f, outbox_partition_interval_seconds %.0f: the alert's ratio %.2f is above 1.5",
		ahead, interval, ahead/interval)
}
