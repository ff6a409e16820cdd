package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// contractBlockingSink blocks every Publish until it gets a token or its
// context ends, and reports each call on entered.
type contractBlockingSink struct {
	entered chan outbox.Event
	tokens  chan struct{}
}

func newContractBlockingSink() *contractBlockingSink {
	return &contractBlockingSink{entered: make(chan outbox.Event, 100), tokens: make(chan struct{}, 100)}
}

func (s *contractBlockingSink) behave(ctx context.Context, e outbox.Event, _ int) error {
	s.entered <- e
	select {
	case <-s.tokens:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// contractShutdownOnCleanup stops r when the test ends, should the test
// stop before doing it itself. A second Shutdown is harmless.
func contractShutdownOnCleanup(t testing.TB, r *outbox.Relay) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = r.Shutdown(ctx)
	})
}

// contractDoneHookCtx runs hook the first time someone asks for Done: the
// moment Shutdown starts waiting on its budget.
type contractDoneHookCtx struct {
	context.Context
	once sync.Once
	hook func()
}

func (c *contractDoneHookCtx) Done() <-chan struct{} {
	c.once.Do(c.hook)
	return c.Context.Done()
}

// contractUnlocked reports which of the events are not row-locked by anyone,
// that is, not claimed by a relay. The lock is the delivery row's, so a
// PUBLISHED event, which has none, is never reported free.
func contractUnlocked(t testing.TB, pool *pgxpool.Pool, ids []string) map[string]bool {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT e.event_id::text FROM outbox_delivery d JOIN outbox_event e ON e.id = d.id
		 WHERE e.event_id = ANY($1::uuid[]) FOR UPDATE OF d SKIP LOCKED`, ids)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	free := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		free[id] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return free
}

// oneAtATimeConfig publishes one event at a time and never detaches a
// publish, so the shutdown tests below know which publish is in progress
// and that every claim is still a row lock when Shutdown begins.
func oneAtATimeConfig() outboxconfig.Config {
	cfg := contractConfig()
	cfg.MaxInFlight = 1
	cfg.DetachAfter = cfg.InFlightTimeout / 2
	return cfg
}

// TestContractShutdownHandsBackClaims: a relay whose sink hangs is shut down
// with a short deadline. The hanging publish is cancelled and every claimed
// event goes back to PENDING without using an attempt (a FAILED event keeps
// its earlier attempts); a fresh relay then publishes them all.
func TestContractShutdownHandsBackClaims(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	cfg := oneAtATimeConfig()

	// Give event A one failed attempt first, so the hand-back is seen to
	// turn FAILED back into PENDING as well. The sink asks for a retry no
	// sooner than 1s, so the first relay cannot retry A before it stops.
	a := contractAppend(t, db.Pool, "a", "order.a")
	first := newContractRecordingSink(func(_ context.Context, e outbox.Event, _ int) error {
		return &outbox.RetryAfterError{Err: errors.New("busy"), After: time.Second}
	})
	r1, err := outbox.NewRelay(db.Pool, first, cfg, "r1", contractTestLogger(t), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r1.Start(ctx); err != nil {
		t.Fatal(err)
	}
	contractShutdownOnCleanup(t, r1) // if the test stops early
	testkit.Eventually(t, 10*time.Second, "A FAILED", func() bool {
		return contractStatusOf(t, db.Pool, a) == outbox.StatusFailed
	})
	if err := r1.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown of an idle relay: %v", err)
	}
	aAttempts := contractRowOf(t, db.Pool, a).Attempts
	if aAttempts != 1 {
		t.Fatalf("A has %d attempts after one failure, want 1", aAttempts)
	}

	ids := []string{a, contractAppend(t, db.Pool, "a", "order.a2")}
	for i := range 4 {
		ids = append(ids, contractAppend(t, db.Pool, fmt.Sprintf("other-%d", i), "order.other"))
	}
	heads := append([]string{ids[0]}, ids[2:]...) // A and the other aggregates' events
	testkit.Eventually(t, 5*time.Second, "A due for its retry", func() bool {
		var due bool
		if err := db.Pool.QueryRow(ctx, `SELECT next_attempt_at <= now() FROM outbox_event_state WHERE event_id = $1`, a).Scan(&due); err != nil {
			t.Fatal(err)
		}
		return due
	})

	blocking := newContractBlockingSink()
	hang := newContractRecordingSink(blocking.behave)
	r2, err := outbox.NewRelay(db.Pool, hang, cfg, "r2", contractTestLogger(t), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r2.Start(ctx); err != nil {
		t.Fatal(err)
	}
	contractShutdownOnCleanup(t, r2) // if the test stops early
	select {
	case e := <-blocking.entered:
		if e.EventID != a {
			t.Fatalf("first publish is %s (%s), want A, the oldest event", e.EventID, e.EventType)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay never called the sink")
	}
	if free := contractUnlocked(t, db.Pool, heads); len(free) != 0 {
		t.Fatalf("%d of the %d head events are not claimed while the sink hangs", len(free), len(heads))
	}

	sctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = r2.Shutdown(sctx)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown with a hanging publish returned %v, want context.DeadlineExceeded", err)
	}
	// The budget plus one bounded hand-back write.
	if took > 6*time.Second {
		t.Errorf("Shutdown took %s with a 300ms budget", took)
	}

	if free := contractUnlocked(t, db.Pool, ids); len(free) != len(ids) {
		t.Errorf("%d of %d events are still locked after Shutdown", len(ids)-len(free), len(ids))
	}
	for i, id := range ids {
		want := 0
		if id == a {
			want = aAttempts
		}
		if r := contractRowOf(t, db.Pool, id); r.Status != outbox.StatusPending || r.Attempts != want {
			t.Errorf("event %d (%s): status %s attempts %d after Shutdown, want PENDING with attempts %d", i, r.AggregateID, r.Status, r.Attempts, want)
		}
		if n := hang.deliveredCount(id); n != 0 {
			t.Errorf("event %d delivered %d times by the relay that was shut down", i, n)
		}
	}

	// A fresh relay publishes everything, A before its successor.
	rec := newContractRecordingSink(nil)
	contractStartRelay(t, db.Pool, rec, cfg, "r3", nil, prometheus.NewRegistry())
	testkit.Eventually(t, 10*time.Second, "every event published by a fresh relay", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusPublished) == len(ids)
	})
	// A kept its failed attempt through the hand-back and spent one more
	// on being published. A published event keeps no attempts, so the
	// fresh relay's sink tells: the publish carried A's earlier attempts.
	if n := rec.publishedOnAttempt(a); n != aAttempts+1 {
		t.Errorf("A: published on attempt %d, want %d", n, aAttempts+1)
	}
	for _, id := range ids {
		if n := rec.deliveredCount(id); n != 1 {
			t.Errorf("event %s delivered %d times by the fresh relay, want 1", id, n)
		}
	}
	contractAssertAggregateOrder(t, db.Pool, rec)
}

// TestContractShutdownLetsPublishFinish: Shutdown with time to spare lets the
// publish in progress complete (it is recorded PUBLISHED) and hands back the
// rest of the batch unattempted.
func TestContractShutdownLetsPublishFinish(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	var ids []string
	for i := range 5 {
		ids = append(ids, contractAppend(t, db.Pool, fmt.Sprintf("agg-%d", i), "order.updated"))
	}
	blocking := newContractBlockingSink()
	rec := newContractRecordingSink(blocking.behave)
	r, err := outbox.NewRelay(db.Pool, rec, oneAtATimeConfig(), "relay", contractTestLogger(t), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	contractShutdownOnCleanup(t, r) // if the test stops early
	select {
	case e := <-blocking.entered:
		if e.EventID != ids[0] {
			t.Fatalf("first publish is %s, want the oldest event %s", e.EventID, ids[0])
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay never called the sink")
	}

	// Let the publish in progress finish once Shutdown is waiting on its
	// context, which it does after it stopped claiming. Should a relay look
	// at the context earlier, the outcome checked below is the same: the
	// event in progress completes, nothing else is attempted or lost.
	tctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	sctx := &contractDoneHookCtx{Context: tctx, hook: func() { blocking.tokens <- struct{}{} }}
	done := make(chan error, 1)
	go func() { done <- r.Shutdown(sctx) }()
	var serr error
	select {
	case serr = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown did not return")
	}
	t.Logf("Shutdown returned %v", serr)
	if serr != nil && !errors.Is(serr, context.DeadlineExceeded) {
		t.Errorf("Shutdown: %v", serr)
	}

	// Published on its first attempt, once: a published event keeps no
	// attempts, so the sink tells.
	if r := contractRowOf(t, db.Pool, ids[0]); r.Status != outbox.StatusPublished || rec.publishedOnAttempt(ids[0]) != 1 || rec.deliveredCount(ids[0]) != 1 {
		t.Errorf("event in progress at Shutdown: status %s, published on attempt %d, delivered %d, want PUBLISHED once, on attempt 1",
			r.Status, rec.publishedOnAttempt(ids[0]), rec.deliveredCount(ids[0]))
	}
	for i, id := range ids[1:] {
		if r := contractRowOf(t, db.Pool, id); r.Status != outbox.StatusPending || r.Attempts != 0 || rec.deliveredCount(id) != 0 {
			t.Errorf("event %d not yet published at Shutdown: status %s attempts %d delivered %d, want PENDING, attempts 0",
				i+1, r.Status, r.Attempts, rec.deliveredCount(id))
		}
	}
	if serr == nil {
		// The graceful path: the relay stopped before the next publish.
		if n := len(rec.allCalls()); n != 1 {
			t.Errorf("Shutdown returned nil but the sink was called %d times, want 1", n)
		}
	}
}
