package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestContractLongUnrelatedTransaction: a long transaction holding an xid
// (the kind that pins the xmin horizon) must not stall the relay: events of
// other aggregates inserted meanwhile are published within a couple of
// seconds each, and this is checked while the transaction is still open.
func TestContractLongUnrelatedTransaction(t *testing.T) {
	const (
		hold     = 10 * time.Second // how long the unrelated transaction stays open
		maxDelay = 2 * time.Second  // per-event bound the contract promises
		every    = 250 * time.Millisecond
	)
	db := pgtest.New(t)
	ctx := context.Background()
	rec := newContractRecordingSink(nil)
	contractStartRelay(t, db.Pool, rec, contractConfig(), "relay", nil, prometheus.NewRegistry())

	long := db.Conn(t)
	if _, err := long.Exec(ctx, `CREATE TABLE contract_scratch (v int)`); err != nil {
		t.Fatal(err)
	}
	tx, err := long.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var xid int64
	if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO contract_scratch VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	opened := time.Now()

	// Insert events at a steady pace (the ticker paces the producer; it
	// synchronizes nothing) and check each one's latency before the next.
	tick := time.NewTicker(every)
	defer tick.Stop()
	var worst time.Duration
	n := 0
	for time.Since(opened) < hold-maxDelay {
		id := contractAppend(t, db.Pool, fmt.Sprintf("agg-%d", n%7), "order.updated")
		inserted := time.Now()
		testkit.Eventually(t, maxDelay, fmt.Sprintf("event %d published during the long transaction", n), func() bool {
			return rec.deliveredCount(id) == 1
		})
		at, _ := rec.deliveredAt(id)
		worst = max(worst, at.Sub(inserted))
		n++
		<-tick.C
	}

	// All of that happened while the transaction was open and held its xid.
	var state string
	var backendXID *int64
	if err := db.Pool.QueryRow(ctx,
		`SELECT state, backend_xid::text::bigint FROM pg_stat_activity WHERE pid = $1`,
		int64(long.PgConn().PID())).Scan(&state, &backendXID); err != nil {
		t.Fatal(err)
	}
	if state != "idle in transaction" || backendXID == nil {
		t.Fatalf("the long transaction is no longer open with an xid (state %q, xid %v)", state, backendXID)
	}
	t.Logf("%d events published during a %s transaction (xid %d); worst latency %s", n, time.Since(opened).Round(time.Millisecond), xid, worst)
	if n < 10 {
		t.Errorf("only %d events were checked during the transaction", n)
	}
}
