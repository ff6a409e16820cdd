package outbox

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestRelayLoopsShareWindows: four loops of one relay drain a backlog in
// per-aggregate order without competing for the same heads. When each loop
// read its own window and tried the same oldest heads as its siblings, this
// drain sent the lock statement 4.6 candidate heads per event (and read 6
// window rows per event); with the windows split between the loops, 0.8
// (and 3-4).
func TestRelayLoopsShareWindows(t *testing.T) {
	t.Parallel()
	const aggregates, perAggregate = 400, 10
	const total = aggregates * perAggregate
	db := pgtest.New(t)
	appendMany(t, db, aggregates, perAggregate, "agg-")
	var claims claimCounter
	pool := db.NewPool(t, 0, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &claims })
	sink := newConcurrencySink(1)
	cfg := testConfig()
	cfg.Relays = 4
	cfg.BatchSize = 100
	startRelay(t, pool, sink, cfg, nil)

	testkit.Eventually(t, 60*time.Second, "every event delivered", func() bool { return sink.delivered() == total })
	sink.checkOrder(t)
	rows, heads := claims.windowRows.Load(), claims.heads.Load()
	t.Logf("%d events: %d window rows read, %d candidate heads sent to the lock statement", total, rows, heads)
	if heads > 3*total/2 {
		t.Errorf("sent %d candidate heads for %d events: the loops compete for the same heads", heads, total)
	}
}

// claimCounter counts the rows that window reads and kept-heads lookups
// return and the candidate heads that lock statements are sent.
type claimCounter struct {
	windowRows, keptHeads, heads atomic.Int64
}

func (c *claimCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if data.SQL == lockSQL(false) {
		c.heads.Add(int64(len(data.Args[0].([]pgtype.TID))))
	}
	return ctx
}

func (*claimCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (*claimCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *claimCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	switch data.SQL {
	case windowSQL:
		c.windowRows.Add(data.CommandTag.RowsAffected())
	case keptHeadsSQL:
		c.keptHeads.Add(data.CommandTag.RowsAffected())
	}
}

func (*claimCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func TestShares(t *testing.T) {
	wake := []chan struct{}{make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{}, 1)}
	s := newShares(wake)
	// 60 aggregates, each a head and a run of one: 2 events.
	var cands []*candidate
	for i := range 60 {
		key := aggregateKey{"order", fmt.Sprint(i)}
		cands = append(cands, &candidate{head: windowRow{id: int64(i), key: key}, run: []windowRow{{id: int64(100 + i), key: key}}})
	}
	for _, c := range cands {
		if s.of(c.head.key) != s.of(aggregateKey{c.head.key.typ, c.head.key.id}) {
			t.Fatal("an aggregate's share changes")
		}
	}

	own, _ := s.split(cands, 0, 6, 0, 0)
	if len(own) != 3 {
		t.Errorf("split returned %d candidates, want 3 (6 events)", len(own))
	}
	taken := map[int][]*candidate{0: own}
	for loop := range 3 {
		taken[loop] = append(taken[loop], drain(s, loop)...)
	}
	seen := 0
	for loop, got := range taken {
		for i, c := range got {
			if s.of(c.head.key) != loop {
				t.Errorf("loop %d was given aggregate %s of loop %d's share", loop, c.head.key.id, s.of(c.head.key))
			}
			if i > 0 && c.head.id <= got[i-1].head.id {
				t.Errorf("loop %d: head %d after %d, want oldest first", loop, c.head.id, got[i-1].head.id)
			}
		}
		seen += len(got)
		if len(got) == 0 {
			t.Errorf("loop %d got no share of 60 aggregates", loop)
		}
	}
	if seen != len(cands) {
		t.Errorf("%d candidates handed out, want each of %d once", seen, len(cands))
	}
	select {
	case <-wake[0]:
		t.Error("the loop that read the window was woken")
	default:
	}
	for loop := 1; loop < 3; loop++ {
		select {
		case <-wake[loop]:
		default:
			t.Errorf("loop %d was not woken for its share", loop)
		}
	}

	// A sibling's share leaves out what its current batch holds: those
	// heads are being published, and gone by its next claim. The loop that
	// reads the window has committed its own batch, so its share does not.
	var held *candidate
	for _, c := range cands {
		if s.of(c.head.key) == 1 {
			held = c
			break
		}
	}
	s.hold(1, [][]claimedRow{{{Event: Event{AggregateType: held.head.key.typ, AggregateID: held.head.key.id}}}})
	s.split(cands, 0, 0, 0, 0)
	if slices.Contains(drain(s, 1), held) {
		t.Error("loop 1's share holds an aggregate its current batch holds")
	}
	if own, _ := s.split(cands, 1, 1000, 0, 0); !slices.Contains(own, held) {
		t.Error("loop 1's own window left out an aggregate of its previous batch")
	}
	s.hold(1, nil)
	s.split(cands, 0, 0, 0, 0)
	if !slices.Contains(drain(s, 1), held) {
		t.Error("an aggregate is still left out after the batch that held it ended")
	}

	// A newer window replaces what an older one left.
	s.split(cands[:1], 0, 0, 0, 0)
	for loop := range 3 {
		if got, _ := s.take(loop, 100, 0, 0); len(got) > 1 {
			t.Errorf("loop %d still had %d candidates of the older window", loop, len(got))
		}
	}
}

// drain takes everything in loop's share, a batch of 2 events at a time.
func drain(s *shares, loop int) []*candidate {
	var out []*candidate
	for {
		more, _ := s.take(loop, 2, 0, 0)
		if more == nil {
			return out
		}
		out = append(out, more...)
	}
}

// A share is taken as the claim cuts it: with runs cut to depth events, a
// claim of n events gets n/depth heads, however long the window's runs,
// and spare times as many again. Counting the whole runs, a claim of 64
// events with runs of 10 in the window got 7 heads.
func TestSharesTakeRunsCutToDepth(t *testing.T) {
	s := newShares([]chan struct{}{make(chan struct{}, 1)})
	var cands []*candidate
	for i := range 300 {
		key := aggregateKey{"order", fmt.Sprint(i)}
		c := &candidate{head: windowRow{id: int64(i), key: key}}
		for j := range 9 {
			c.run = append(c.run, windowRow{id: int64(1000 + 10*i + j), key: key})
		}
		cands = append(cands, c)
	}
	if got, _ := s.split(cands, 0, 32, 2, 0); len(got) != 16 {
		t.Errorf("a claim of 32 events in runs of at most 2 took %d heads, want 16", len(got))
	}
	if got, _ := s.take(0, 32, 1, 2); len(got) != 96 {
		t.Errorf("a claim of 32 events in runs of 1 took %d heads, want 32 and 64 spare", len(got))
	}
	if got, _ := s.take(0, 20, 0, 2); len(got) != 6 {
		t.Errorf("a claim of 20 events with runs unbounded took %d heads of 10 events, want 2 and 4 spare", len(got))
	}
}

// The spare heads a claim's lock statement never came to go back to the
// front of the share, unless a newer window replaced it meanwhile.
func TestSharesGiveBackWhatTheClaimNeverTried(t *testing.T) {
	s := newShares([]chan struct{}{make(chan struct{}, 1)})
	var cands []*candidate
	for i := range 10 {
		cands = append(cands, &candidate{head: windowRow{id: int64(i), key: aggregateKey{"order", fmt.Sprint(i)}}})
	}
	s.split(cands, 0, 0, 0, 0)
	got, gen := s.take(0, 2, 0, 2)
	if len(got) != 6 {
		t.Fatalf("took %d heads, want 6", len(got))
	}
	s.giveBack(0, gen, got[2:])
	if next, _ := s.take(0, 1, 0, 2); len(next) != 3 || next[0] != cands[2] {
		t.Errorf("after giving back heads 2-5, the next claim took %d heads from %d, want heads 2, 3 and 4", len(next), next[0].head.id)
	}
	got, gen = s.take(0, 1, 0, 0)
	s.split(cands[9:], 0, 0, 0, 0)
	s.giveBack(0, gen, got)
	if next, _ := s.take(0, 10, 0, 0); len(next) != 1 || next[0] != cands[9] {
		t.Errorf("after a newer window, the share holds %d heads, want only head 9", len(next))
	}
}

// Loops of other processes hold some of a share's heads. A claim that
// offers spares passes over them and still locks the heads it needs, and
// gives back the spares the lock statement never came to; one without
// spares locks only what nobody holds among the heads it needs.
func TestSpareHeadsPassOverHeadsOthersHold(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	for i := range 20 {
		appendEvent(t, db.Pool, fmt.Sprintf("agg-%02d", i), "created")
	}
	// Another process's loop holds the five oldest heads.
	other, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx)
	if _, err := other.Exec(ctx, `SELECT 1 FROM outbox_delivery WHERE aggregate_id < 'agg-05' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}

	c, tx, cands := lockWindowSetup(t, db, testConfig())
	s := newShares([]chan struct{}{make(chan struct{}, 1)})
	s.split(cands, 0, 0, 0, 0)

	plain, _ := s.take(0, 5, 0, 0)
	runs, _, err := c.lockWindow(ctx, tx.Conn(), plain, 5, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 0 {
		t.Errorf("without spares the claim locked %d heads, want none: the five it needs are held", len(runs))
	}

	s.split(cands, 0, 0, 0, 0)
	spared, gen := s.take(0, 5, 0, spareHeads)
	runs, rest, err := c.lockWindow(ctx, tx.Conn(), spared, 5, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 5 || runs[0][0].AggregateID != "agg-05" {
		t.Fatalf("with spares the claim locked %d heads, want five from agg-05 on", len(runs))
	}
	s.giveBack(0, gen, rest)
	if next, _ := s.take(0, 1, 0, 0); len(rest) != 5 || len(next) != 1 || next[0].head.key.id != "agg-10" {
		t.Errorf("%d spares given back, and the next claim starts at %v; want five, from agg-10", len(rest), next)
	}
}

// A sink-bound loop whose share went stale, because the heads it offers
// were published since a sibling read the window, still claims the current
// heads of the aggregates its last batch held (keptHeadsSQL), after the
// older head of an aggregate nobody holds. Without them this claim locks
// o1 alone.
func TestClaimFromAStaleShareKeepsItsAggregates(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	appendEvent(t, db.Pool, "o", "o1")
	k1 := appendEvent(t, db.Pool, "k", "k1")
	appendEvent(t, db.Pool, "k", "k2")
	appendEvent(t, db.Pool, "k", "k3")
	appendEvent(t, db.Pool, "k", "k4")

	cfg := testConfig()
	cfg.Relays = 2
	r, err := NewRelay(db.Pool, &recorder{}, cfg, "t", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub := r.pub.(*publisher)
	pub.latency.Store(int64(cfg.DetachAfter / 2)) // sink-bound: runs of two events
	win, err := readWindow(db.Pool.Query(ctx, windowSQL, 100))
	if err != nil {
		t.Fatal(err)
	}
	r.claimers[0].shares.queue[0] = candidates(win) // the share a sibling's window left
	// The loop's last batch published k1 after that window was read.
	exec(t, db.Pool, `DELETE FROM outbox_delivery WHERE id = (SELECT id FROM outbox_event WHERE event_id = $1)`, k1) // published

	c := r.claimers[0]
	c.window, c.kept = c.minWindow(), []aggregateKey{{"order", "k"}}
	pc, _ := pub.pace(ctx, false, false)
	got := claimOnce(t, c, pc)
	if fmt.Sprint(got) != "[[o1] [k2 k3]]" {
		t.Errorf("claimed %v, want [[o1] [k2 k3]]: o1, the oldest head, then k's current head and run", got)
	}
}

// TestReplicasKeepingAggregatesKeepOrder: three replicas of two loops race
// over few aggregates through a sink-bound sink, so loops keep their
// aggregates from batch to batch while the others' loops claim around
// them. Every event arrives once per publish, in per-aggregate order, never
// two of one aggregate at once, and claims did use the kept heads.
func TestReplicasKeepingAggregatesKeepOrder(t *testing.T) {
	t.Parallel()
	const aggregates, perAggregate = 20, 30
	db := pgtest.New(t)
	appendMany(t, db, aggregates, perAggregate, "agg-")
	sink := newConcurrencySink(1)
	sink.delay = 15 * time.Millisecond // above a tenth of detach_after: sink-bound
	cfg := testConfig()
	cfg.Relays = 2
	cfg.MaxInFlight = 4
	var claims claimCounter
	for range 3 {
		pool := db.NewPool(t, 0, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &claims })
		startRelay(t, pool, sink, cfg, nil)
	}

	total := aggregates * perAggregate
	testkit.Eventually(t, 60*time.Second, "every event delivered", func() bool { return sink.delivered() == total })
	sink.checkOrder(t)
	if claims.keptHeads.Load() == 0 {
		t.Error("no claim read the heads of the aggregates its loop kept")
	}
}
