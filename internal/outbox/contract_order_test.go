package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
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

// contractCountingSink counts what one relay delivered and forwards to the
// shared recorder, so the test sees every relay take part.
type contractCountingSink struct {
	inner *contractRecordingSink
	n     atomic.Int64
}

func (s *contractCountingSink) Name() string { return s.inner.Name() }

func (s *contractCountingSink) Publish(ctx context.Context, e outbox.Event) error {
	err := s.inner.Publish(ctx, e)
	if err == nil {
		s.n.Add(1)
	}
	return err
}

// TestContractOrderThreeRelays: three relays in three pools (three
// "replicas") drain events that concurrent producers keep inserting. Every
// event arrives exactly once (no faults are injected) and each aggregate's
// events arrive in insertion (id) order.
func TestContractOrderThreeRelays(t *testing.T) {
	const (
		aggregates = 200
		backlog    = 5_000  // inserted before the relays start
		hotBacklog = 2_000  // the oldest backlog events, all of one aggregate
		total      = 20_000 // backlog + what the producers add while relays run
		producers  = 6
	)
	db := pgtest.New(t)
	ctx := context.Background()
	aggID := func(i int) string { return fmt.Sprintf("agg-%03d", i) }

	// Backlog through the plain SQL contract, one multi-row statement. The
	// oldest events all belong to one hot aggregate: while one relay holds
	// it, the others find the oldest rows unclaimable and must look past
	// them, without overtaking the hot aggregate's own later events.
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT $1, CASE WHEN g <= $4 THEN 'agg-000'
                ELSE 'agg-' || lpad(((hashint4(g) & 2147483647) % $3)::text, 3, '0') END,
       'order.backlog', jsonb_build_object('g', g)
FROM generate_series(1, $2) g ORDER BY g`, contractAggregateType, backlog, aggregates, hotBacklog); err != nil {
		t.Fatal(err)
	}

	rec := newContractRecordingSink(nil)
	cfg := contractConfig()
	cfg.Relays = 2
	cfg.BatchSize = 100
	log, logs := contractJSONLogger(t)
	var counters []*contractCountingSink
	for i := range 3 {
		sink := &contractCountingSink{inner: rec}
		counters = append(counters, sink)
		contractStartRelay(t, db.NewPool(t, 4), sink, cfg, fmt.Sprintf("relay-%d", i), log, prometheus.NewRegistry())
	}

	// Producers race on shared aggregates while the relays run: half the
	// transactions use outbox.Append, half a plain multi-row INSERT. Within
	// a transaction aggregates are appended in sorted order, as the
	// migration asks, so producers cannot deadlock on the aggregate locks.
	var produced atomic.Int64
	produced.Store(backlog)
	var wg sync.WaitGroup
	for p := range producers {
		pool := db.NewPool(t, 2)
		quota := (total - backlog) / producers
		if p == 0 {
			quota += (total - backlog) % producers
		}
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(p), 42))
			for done := 0; done < quota; {
				n := min(1+rnd.IntN(20), quota-done)
				aggs := make([]string, n)
				for i := range aggs {
					aggs[i] = aggID(rnd.IntN(aggregates))
				}
				slices.Sort(aggs)
				var err error
				if rnd.IntN(2) == 0 {
					err = contractAppendTx(ctx, pool, aggs, p)
				} else {
					err = contractInsertTx(ctx, pool, aggs, p)
				}
				if err != nil {
					t.Errorf("producer %d: %v", p, err)
					return
				}
				done += n
				produced.Add(int64(n))
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if got := produced.Load(); got != total {
		t.Fatalf("produced %d events, want %d", got, total)
	}

	testkit.Eventually(t, 90*time.Second, "every event PUBLISHED", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusPublished) == total
	})
	testkit.Eventually(t, 10*time.Second, "the sink to see every event", func() bool {
		return rec.distinctDelivered() == total
	})

	rows := contractRows(t, db.Pool)
	if len(rows) != total {
		t.Fatalf("outbox_event has %d rows, want %d", len(rows), total)
	}
	want := map[string][]string{} // aggregate -> event_ids in id order
	seq := map[string]int64{}
	for _, r := range rows {
		if r.Status != outbox.StatusPublished {
			t.Errorf("event %s (id %d): status %s, want PUBLISHED", r.EventID, r.ID, r.Status)
		}
		want[r.AggregateID] = append(want[r.AggregateID], r.EventID)
		seq[r.EventID] = r.ID
	}
	if len(want) != aggregates {
		t.Errorf("events cover %d aggregates, want %d", len(want), aggregates)
	}

	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.calls) != total {
		t.Errorf("sink got %d Publish calls for %d events: duplicates without any fault", len(rec.calls), total)
	}
	// Each event published after one attempt: a published event keeps no
	// attempts in the outbox, so the sink tells. One call, and the call
	// carried no earlier attempt.
	for _, r := range rows {
		if n := rec.callsByID[r.EventID]; n != 1 {
			t.Errorf("event %s (id %d): %d Publish calls, want PUBLISHED after 1 attempt", r.EventID, r.ID, n)
		}
	}
	for _, e := range rec.calls {
		if e.Attempts != 0 {
			t.Errorf("event %s handed to the sink with %d earlier attempts, want 0: nothing failed", e.EventID, e.Attempts)
		}
	}
	for id, n := range rec.okByID {
		if n != 1 {
			t.Errorf("event %s delivered %d times, want once", id, n)
		}
	}
	for agg, ids := range want {
		var got []string
		for _, e := range rec.byAggregate[agg] {
			got = append(got, e.EventID)
			if e.Seq != seq[e.EventID] {
				t.Errorf("event %s carries Seq %d, want its id %d", e.EventID, e.Seq, seq[e.EventID])
			}
		}
		// Duplicates are counted above; here only order: a redelivery (after
		// a failed commit) is not a reorder.
		if early, missed, ok := contractFirstOvertake(ids, got); !ok {
			t.Errorf("aggregate %s: event %s (id %d) arrived before the earlier event %s (id %d) had arrived once", agg, early, seq[early], missed, seq[missed])
		}
	}
	for i, c := range counters {
		t.Logf("relay-%d delivered %d events", i, c.n.Load())
		if c.n.Load() == 0 {
			t.Errorf("relay-%d delivered nothing: the relays did not run concurrently", i)
		}
	}
	// Nothing failed, so nothing may be reported as failing.
	contractAssertNoWarnings(t, logs)
}

// contractFirstOvertake checks one aggregate's deliveries (got, in arrival
// order) against its events (ids, in insertion order) as at-least-once
// delivery allows: an event may arrive again, but never before every
// earlier event of its aggregate has arrived at least once. It returns the
// first event that overtook one, and the event it overtook.
func contractFirstOvertake(ids, got []string) (early, missed string, ok bool) {
	pos := make(map[string]int, len(ids))
	for i, id := range ids {
		pos[id] = i
	}
	arrived := make(map[string]bool, len(ids))
	next := 0 // ids[:next] have all arrived
	for _, id := range got {
		if pos[id] > next {
			return id, ids[next], false
		}
		arrived[id] = true
		for next < len(ids) && arrived[ids[next]] {
			next++
		}
	}
	return "", "", true
}

// contractAssertNoWarnings fails the test for every log line at WARN or
// above: in a run without injected faults each one is a relay defect.
func contractAssertNoWarnings(t testing.TB, logs *testkit.LogBuffer) {
	t.Helper()
	n := 0
	for _, l := range logs.Lines(t, "") {
		if l["level"] == "WARN" || l["level"] == "ERROR" {
			if n++; n <= 5 {
				t.Errorf("relay logged %v %q without any fault injected (error: %v)", l["level"], l["msg"], l["error"])
			}
		}
	}
	if n > 5 {
		t.Errorf("... %d such lines in all", n)
	}
}

// TestContractNoStarvationBehindHeldAggregate: one relay holds a hot
// aggregate whose backlog fills far more than a batch (its sink hangs on
// that aggregate), so the oldest unfinished rows are all unclaimable. A second relay must look
// past them and publish the other aggregates, without taking any of the
// hot aggregate's later events; once the first relay lets go, the hot
// aggregate drains in order.
func TestContractNoStarvationBehindHeldAggregate(t *testing.T) {
	t.Parallel()
	const (
		hot    = 2_000 // 20 batches of the hot aggregate before anything else
		others = 50
	)
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT $1, CASE WHEN g <= $2::int THEN 'hot' ELSE 'other-' || g % 10 END, 'order.updated', jsonb_build_object('g', g)
FROM generate_series(1, $2::int + $3::int) g ORDER BY g`, contractAggregateType, hot, others); err != nil {
		t.Fatal(err)
	}
	cfg := contractConfig()

	// The holder: claims the hot aggregate's head and hangs on it.
	blocking := newContractBlockingSink()
	holderSink := newContractRecordingSink(func(ctx context.Context, e outbox.Event, call int) error {
		if e.AggregateID != "hot" {
			return nil
		}
		return blocking.behave(ctx, e, call)
	})
	holder, err := outbox.NewRelay(db.NewPool(t, 4), holderSink, cfg, "holder", contractTestLogger(t), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(ctx); err != nil {
		t.Fatal(err)
	}
	contractShutdownOnCleanup(t, holder)
	select {
	case e := <-blocking.entered:
		if e.AggregateID != "hot" {
			t.Fatalf("holder publishes %s first, want the hot aggregate's head", e.AggregateID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the holder never called its sink")
	}

	log, logs := contractJSONLogger(t)
	rec := newContractRecordingSink(nil)
	contractStartRelay(t, db.NewPool(t, 4), rec, cfg, "worker", log, prometheus.NewRegistry())
	testkit.Eventually(t, 15*time.Second, "the other aggregates published past the held backlog", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusPublished) >= others
	})
	for _, d := range rec.deliveries() {
		if d.Event.AggregateID == "hot" {
			t.Fatalf("hot event %d published while the holder still holds the aggregate's head", d.Event.Seq)
		}
	}
	contractAssertNoWarnings(t, logs)

	// Let go: the holder hands back, and the hot aggregate drains in order.
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_ = holder.Shutdown(sctx) // DeadlineExceeded: its publish hangs
	testkit.Eventually(t, 30*time.Second, "the hot aggregate drained", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusPublished) == hot+others
	})
	// The holder's one call that never answered is the only one too many.
	if n := len(rec.allCalls()) + len(holderSink.allCalls()); n != hot+others+1 {
		t.Errorf("sinks got %d calls for %d events and the hung one", n, hot+others)
	}
	contractAssertAggregateOrder(t, db.Pool, rec)
	contractAssertAggregateOrder(t, db.Pool, holderSink)
}

// contractAppendTx appends one event per entry of aggs in one transaction
// through outbox.Append.
func contractAppendTx(ctx context.Context, pool *pgxpool.Pool, aggs []string, producer int) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, a := range aggs {
			if _, err := outbox.Append(ctx, tx, contractNewEvent(a, fmt.Sprintf("order.p%d", producer))); err != nil {
				return err
			}
		}
		return nil
	})
}

// contractInsertTx inserts one event per entry of aggs with the plain SQL
// contract, one multi-row statement, rows in array order.
func contractInsertTx(ctx context.Context, pool *pgxpool.Pool, aggs []string, producer int) error {
	_, err := pool.Exec(ctx, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT $1, a.agg, $3, jsonb_build_object('producer', $4::int, 'n', a.n)
FROM unnest($2::text[]) WITH ORDINALITY AS a(agg, n)
ORDER BY a.n`, contractAggregateType, aggs, fmt.Sprintf("order.p%d", producer), producer)
	return err
}

// The order check tells a redelivery from a reorder.
func TestContractFirstOvertake(t *testing.T) {
	ids := []string{"a", "b", "c"}
	cases := []struct {
		got          []string
		early, known string
		ok           bool
	}{
		{[]string{"a", "b", "c"}, "", "", true},
		{[]string{"a", "b", "a", "b", "c"}, "", "", true}, // a batch redelivered after its commit failed
		{[]string{"a", "a", "b", "c", "c"}, "", "", true},
		{[]string{"b", "a", "c"}, "b", "a", false},
		{[]string{"a", "c", "b"}, "c", "b", false},
		{[]string{"a", "b", "a", "c", "b"}, "", "", true},
	}
	for _, c := range cases {
		early, missed, ok := contractFirstOvertake(ids, c.got)
		if ok != c.ok || early != c.early || missed != c.known {
			t.Errorf("%v: got (%q, %q, %v), want (%q, %q, %v)", c.got, early, missed, ok, c.early, c.known, c.ok)
		}
	}
}
