package outbox

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
)

func TestNextSize(t *testing.T) {
	cfg := testConfig()
	cfg.MaxInFlight = 64
	c := &claimer{cfg: cfg} // batch_size 500
	for _, tc := range []struct {
		size int
		out  outcomes
		want int
		why  string
	}{
		{500, outcomes{started: 500}, 500, "a batch that finished keeps batch_size"},
		{500, outcomes{started: 120, cutShort: true}, 120, "cut short: claim what was started"},
		{120, outcomes{started: 120}, 240, "finished: double"},
		{400, outcomes{started: 400}, 500, "double, up to batch_size"},
		{100, outcomes{started: 300, cutShort: true}, 100, "never more than was claimed"},
		{10, outcomes{started: 0, cutShort: true}, 1, "at least one"},
	} {
		if got := c.nextSize(tc.size, &tc.out); got != tc.want {
			t.Errorf("%s: nextSize(%d, started %d) = %d, want %d", tc.why, tc.size, tc.out.started, got, tc.want)
		}
	}
	for _, tc := range []struct{ n, want int }{{500, 0}, {499, 8}, {64, 1}, {65, 2}, {1, 1}} {
		if got := c.depth(pace{}, tc.n); got != tc.want {
			t.Errorf("depth(%d) with max_in_flight 64 = %d, want %d", tc.n, got, tc.want)
		}
	}
}

// Heads are locked by ctid. Should the slot the window saw hold another row
// by the time of the lock (the head's version died and VACUUM let a new row
// in), the relay must not take that row for the head: it may be an event
// whose own aggregate's head waits for a retry.
func TestLockWindowChecksHeadIdentity(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	c1 := appendEvent(t, db.Pool, "c", "c1")
	c2 := appendEvent(t, db.Pool, "c", "c2")
	appendEvent(t, db.Pool, "a", "a1")
	setDelivery(t, db.Pool, c1, "status = 'FAILED', attempts = 1, next_attempt_at = now() + interval '1 hour'")
	c, tx, cands := lockWindowSetup(t, db, testConfig())
	if len(cands) != 1 || cands[0].head.key.id != "a" {
		t.Fatalf("candidates %+v, want only aggregate a", cands)
	}
	// Stand in for the slot being reused: the head's slot now holds c2.
	if err := tx.QueryRow(ctx, `SELECT d.ctid FROM outbox_delivery d JOIN outbox_event e ON e.id = d.id WHERE e.event_id = $1`, c2).Scan(&cands[0].head.tid); err != nil {
		t.Fatal(err)
	}
	runs, _, err := c.lockWindow(ctx, tx.Conn(), cands, 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, run := range runs {
		for _, ev := range run {
			t.Errorf("claimed %s %s (seq %d), which is not the head the window saw", ev.AggregateID, ev.EventType, ev.Seq)
		}
	}
}

// With block_on_dead an aggregate's later events wait behind its DEAD
// event, which the window does not read. If an operator requeues that event
// between the window and the lock, the later event is no longer the head:
// the lock must not take it.
func TestLockWindowSeesRetriedDeadEvent(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	dead := appendEvent(t, db.Pool, "x", "x1")
	appendEvent(t, db.Pool, "x", "x2")
	setDelivery(t, db.Pool, dead, "status = 'DEAD', attempts = 3, dead_at = now()")
	cfg := testConfig()
	cfg.BlockOnDead = true
	c, tx, cands := lockWindowSetup(t, db, cfg)
	if len(cands) != 1 {
		t.Fatalf("candidates %+v, want x2 alone", cands)
	}
	if n, err := RetryDead(ctx, db.Pool, dead, "ops", nil); err != nil || n != 1 {
		t.Fatalf("RetryDead = %d, %v", n, err)
	}
	runs, _, err := c.lockWindow(ctx, tx.Conn(), cands, 100, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, run := range runs {
		for _, ev := range run {
			t.Errorf("claimed %s (seq %d) although the requeued x1 comes before it", ev.EventType, ev.Seq)
		}
	}
}

// lockWindowSetup returns a relay's claimer, an open transaction (rolled
// back at the end of the test) and the candidates of a window read in it,
// for tests that change the table between the window and lockWindow.
func lockWindowSetup(t *testing.T, db *pgtest.DB, cfg outboxconfig.Config) (*claimer, pgx.Tx, []*candidate) {
	t.Helper()
	ctx := context.Background()
	r, err := NewRelay(db.Pool, &recorder{}, cfg, "t", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(ctx) })
	win, err := readWindow(tx.Query(ctx, windowSQL, 100))
	if err != nil {
		t.Fatal(err)
	}
	return r.claimers[0], tx, candidates(win)
}

// When the widest window is blocked (one hot aggregate, held by another
// transaction, fills it), the claim looks behind it. The look must not
// return the heads this claim already locked from the window: a
// transaction's own row locks do not skip, so they would come back twice,
// and be published twice and out of order.
func TestClaimLooksBehindWithoutRetakingItsHeads(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	appendEvent(t, db.Pool, "b", "b1")
	hot := appendEvent(t, db.Pool, "hot", "hot")
	exec(t, db.Pool, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', 'hot', 'hot', '{}' FROM generate_series(1, 100)`)
	appendEvent(t, db.Pool, "c", "c1")
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM outbox_delivery WHERE id = (SELECT id FROM outbox_event WHERE event_id = $1) FOR UPDATE`, hot); err != nil {
		t.Fatal(err)
	}

	cfg := testConfig()
	cfg.BatchSize = 10
	r, err := NewRelay(db.Pool, &recorder{}, cfg, "t", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := r.claimers[0]
	c.window = maxWindowFactor * cfg.BatchSize
	if got := claimOnce(t, c, pace{}); fmt.Sprint(got) != "[[b1] [c1]]" {
		t.Errorf("claimed %v, want [[b1] [c1]]: b1 from the window, c1 from behind it, each once", got)
	}
}

// claimOnce has c claim once as pc asks, on a connection of its own, and
// returns the event types of the runs it locked, rolling the claim back.
func claimOnce(t *testing.T, c *claimer, pc pace) [][]string {
	t.Helper()
	ctx := context.Background()
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.conn = conn
	defer c.settle()
	cl, err := c.claim(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	var got [][]string
	for _, run := range cl.runs {
		var types []string
		for _, ev := range run {
			types = append(types, ev.EventType)
		}
		got = append(got, types)
	}
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	return got
}
