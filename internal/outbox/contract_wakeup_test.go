package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
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

// TestALoneEventIsOneClaim: at a low rate each event costs one claim. The
// claim that took it read every live event, so the relay commits the
// outcome and waits for the next notification, instead of claiming again
// only to commit it and find nothing. Polling is an hour away, so each
// event below is found by its notification alone.
func TestALoneEventIsOneClaim(t *testing.T) {
	const events = 5
	db := pgtest.New(t)
	var windows atomic.Int64
	pool := db.NewPool(t, 4, func(c *pgxpool.Config) { c.ConnConfig.Tracer = windowReads{&windows} })
	rec := newContractRecordingSink(nil)
	cfg := contractConfig()
	cfg.PollInterval = time.Hour
	contractStartRelay(t, pool, rec, cfg, "relay", nil, prometheus.NewRegistry())

	published := func(id string) {
		testkit.Eventually(t, 10*time.Second, "event "+id+" published and its outcome committed", func() bool {
			return rec.deliveredCount(id) == 1 && contractStatusOf(t, db.Pool, id) == outbox.StatusPublished
		})
	}
	published(contractAppend(t, db.Pool, "agg-0", "order.updated"))
	before := windows.Load()
	for i := range events {
		published(contractAppend(t, db.Pool, fmt.Sprintf("agg-%d", i%2), "order.updated"))
	}
	// Claiming again after each event read two windows an event.
	if got := windows.Load() - before; got > events+1 {
		t.Fatalf("%d events, one at a time, read %d windows; want one each", events, got)
	}
}

// windowReads counts the relay's window reads (windowSQL), which it sends
// in a batch.
type windowReads struct{ n *atomic.Int64 }

func (w windowReads) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (w windowReads) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (w windowReads) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (w windowReads) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if strings.Contains(d.SQL, "FROM outbox_delivery WHERE") && strings.Contains(d.SQL, "ORDER BY id LIMIT $1") {
		w.n.Add(1)
	}
}
func (w windowReads) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
