package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// extendConfig makes the relay sink-bound with a 40 ms sink (slower than
// a tenth of detach_after) and claims at most 3 events a batch, so that a
// batch publishes more than it claimed only by extending its runs.
func extendConfig() outboxconfig.Config {
	cfg := contractConfig()
	cfg.BatchSize = 3
	cfg.MaxInFlight = 4
	cfg.DetachAfter = 200 * time.Millisecond
	return cfg
}

// slowRecordingSink answers every publish after 40 ms.
func slowRecordingSink() *contractRecordingSink {
	return newContractRecordingSink(func(ctx context.Context, _ outbox.Event, _ int) error {
		select {
		case <-time.After(40 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
}

// startWarmRelay starts a relay with extendConfig and a 40 ms sink, and
// publishes events through it until its moving average of the sink's
// latency says the sink is slow.
func startWarmRelay(t *testing.T) (*pgtest.DB, *contractRecordingSink) {
	t.Helper()
	db := pgtest.New(t)
	sink := slowRecordingSink()
	contractStartRelay(t, db.Pool, sink, extendConfig(), "relay", nil, prometheus.NewRegistry())
	var evs []outbox.NewEvent
	for range 12 {
		evs = append(evs, contractNewEvent("warm-up", "order.changed"))
	}
	ids := contractAppendInOneTx(t, db.Pool, evs...)
	testkit.Eventually(t, 10*time.Second, "the warm-up events published", func() bool {
		return sink.deliveredCount(ids[len(ids)-1]) == 1
	})
	return db, sink
}

// TestContractSlowSinkBatchExtendsItsRuns: with a slow sink, a batch whose
// runs end before detach_after locks its aggregates' next events in its
// own transaction and publishes them, in order: one transaction marks more
// events PUBLISHED than a claim takes (batch_size 3).
func TestContractSlowSinkBatchExtendsItsRuns(t *testing.T) {
	t.Parallel()
	db, sink := startWarmRelay(t)

	// A published event's delivery row is deleted, and nothing of the
	// transaction that published it stays behind: the record keeps, for
	// each, the transaction that deleted its delivery row.
	outboxtest.RecordPublishes(t, db.Pool)

	var evs []outbox.NewEvent
	for i := range 60 {
		evs = append(evs, contractNewEvent(fmt.Sprintf("agg-%d", i%2), "order.changed"))
	}
	ids := contractAppendInOneTx(t, db.Pool, evs...)
	testkit.Eventually(t, 20*time.Second, "every event published", allInStatus(t, db.Pool, ids, outbox.StatusPublished))
	assertOrdered(t, sink)

	// The PUBLISHED marks of a batch (deletes of delivery rows) are written
	// by its own transaction.
	var most int
	if err := db.Pool.QueryRow(t.Context(), `
		SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM test_publish
		                                 WHERE aggregate_id LIKE 'agg-%' GROUP BY xact) t`).Scan(&most); err != nil {
		t.Fatal(err)
	}
	if most <= extendConfig().BatchSize {
		t.Errorf("no transaction published more than %d events (most: %d): runs were not extended", extendConfig().BatchSize, most)
	}
}

// TestContractRunExtensionStopsAtAHeldEvent: an extended run stops before
// an event that another session holds; the events behind it wait, and are
// published after it, in order, once it is free.
func TestContractRunExtensionStopsAtAHeldEvent(t *testing.T) {
	t.Parallel()
	db, sink := startWarmRelay(t)

	var evs []outbox.NewEvent
	for range 12 {
		evs = append(evs, contractNewEvent("held", "order.changed"))
	}
	// The producer's transaction commits all twelve; an operator's session
	// then holds the fourth before the relay reaches it. A batch claims the
	// first three, and its run asks for more at once.
	conn := db.Conn(t)
	tx, err := conn.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	ids := contractAppendInOneTx(t, db.Pool, evs...)
	if _, err := tx.Exec(t.Context(), `SELECT 1 FROM outbox_delivery WHERE id = (SELECT id FROM outbox_event WHERE event_id = $1) FOR UPDATE`, ids[3]); err != nil {
		t.Fatal(err)
	}
	if sink.callCount(ids[3]) > 0 {
		t.Fatal("the relay reached the fourth event before the session held it")
	}
	testkit.Eventually(t, 10*time.Second, "the events before the held one published", allInStatus(t, db.Pool, ids[:3], outbox.StatusPublished))
	if err := tx.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "every event published", allInStatus(t, db.Pool, ids, outbox.StatusPublished))
	assertOrdered(t, sink)
}
