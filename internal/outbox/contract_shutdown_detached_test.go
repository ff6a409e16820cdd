package outbox_test

// Shutdown while publishes are detached: the batch committed with those
// events IN_FLIGHT under an owner token and the publishes go on by
// themselves (docs/outbox-internals.md, "Slow publishes"). The relays here publish
// concurrently and detach after detach_after, as configured by default.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// contractFinishTimeout is the relay's bound on each of its final writes
// (finishTimeout in relay.go).
const contractFinishTimeout = 5 * time.Second

// contractStopBound is how long a stop may take once its budget is gone:
// the final writes' bound and a second for the rest (a cancelled publish
// given a moment to return, detach_after, scheduling on a busy machine).
const contractStopBound = contractFinishTimeout + time.Second

// contractHold holds the first publish of chosen events until the test
// lets it go. An obedient held call also ends when its context does, as a
// sink should; a stuck one ignores its context, as a client waiting for a
// broker's confirmation may.
type contractHold struct {
	release map[string]chan error // per held event: the outcome of its held call
	stuck   map[string]bool
}

func newContractHold(obedient, stuck []string) *contractHold {
	h := &contractHold{release: map[string]chan error{}, stuck: map[string]bool{}}
	for _, id := range append(append([]string(nil), obedient...), stuck...) {
		h.release[id] = make(chan error, 1)
	}
	for _, id := range stuck {
		h.stuck[id] = true
	}
	return h
}

func (h *contractHold) behave(ctx context.Context, e outbox.Event, call int) error {
	release, held := h.release[e.EventID]
	if !held || call > 1 {
		return nil
	}
	if h.stuck[e.EventID] {
		return <-release
	}
	select {
	case err := <-release:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// let ends the held call of id with err (nil: published). Letting go an
// event twice changes nothing.
func (h *contractHold) let(id string, err error) {
	select {
	case h.release[id] <- err:
	default:
	}
}

func (h *contractHold) letAll(err error) {
	for id := range h.release {
		h.let(id, err)
	}
}

// contractAwaitDetachedDone waits until the stopped relay registered on
// reg holds just outstanding claims: the detached publishes that have not
// returned. The others have returned and tried to record their outcomes.
func contractAwaitDetachedDone(t testing.TB, reg prometheus.Gatherer, outstanding float64) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, fmt.Sprintf("%v detached publishes outstanding", outstanding), func() bool {
		v, ok := testkit.Metric(t, reg, "outbox_claimed_events", nil)
		return ok && v == outstanding
	})
}

// contractReleaseOnCleanup lets every held call go when the test ends and
// waits for the relay to be done with them, so no publish outlives the test
// (its log would reach a finished test) or the database.
func contractReleaseOnCleanup(t testing.TB, h *contractHold, reg prometheus.Gatherer) {
	t.Cleanup(func() {
		h.letAll(errors.New("test over"))
		contractAwaitDetachedDone(t, reg, 0)
	})
}

// contractClaim is an event's claim columns. A PUBLISHED event has none
// (its delivery row is deleted): it reads 0 attempts, no owner and not
// due; who published it and on which attempt is read from the sinks
// (contractAssertOwnedBy, publishedOnAttempt).
type contractClaim struct {
	Status    string
	Attempts  int
	ClaimedBy string // "" for NULL
	Due       bool   // next_attempt_at has passed: claimable
}

func contractClaimOf(t testing.TB, pool *pgxpool.Pool, eventID string) contractClaim {
	t.Helper()
	var c contractClaim
	err := pool.QueryRow(context.Background(),
		`SELECT status, coalesce(attempts, 0), coalesce(claimed_by, ''), coalesce(next_attempt_at <= now(), false)
		 FROM outbox_event_state WHERE event_id = $1`,
		eventID).Scan(&c.Status, &c.Attempts, &c.ClaimedBy, &c.Due)
	if err != nil {
		t.Fatalf("read event %s: %v", eventID, err)
	}
	return c
}

// contractHeldBacklog appends n aggregates (prefix-0, prefix-1, ...) of two
// events each, and returns their heads and the events behind them.
func contractHeldBacklog(t testing.TB, pool *pgxpool.Pool, prefix string, n int) (heads, behind []string) {
	t.Helper()
	for i := range n {
		agg := fmt.Sprintf("%s-%d", prefix, i)
		heads = append(heads, contractAppend(t, pool, agg, "order.created"))
		behind = append(behind, contractAppend(t, pool, agg, "order.updated"))
	}
	return heads, behind
}

func contractAwaitStatus(t testing.TB, pool *pgxpool.Pool, ids []string, status, what string) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, what, func() bool {
		for _, id := range ids {
			if contractStatusOf(t, pool, id) != status {
				return false
			}
		}
		return true
	})
}

// contractStartDetaching starts relay r1 with a cancellable Start context
// and a sink whose held calls (rec's behave) are h's: the held heads are
// detached, the free aggregates publish. It returns once every held head is
// IN_FLIGHT and the free ones are PUBLISHED.
func contractStartDetaching(t *testing.T, pool *pgxpool.Pool, rec *contractRecordingSink, h *contractHold, heads, free []string, reg *prometheus.Registry) (*outbox.Relay, context.CancelFunc) {
	t.Helper()
	r, err := outbox.NewRelay(pool, rec, contractConfig(), "r1", contractTestLogger(t), reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	contractShutdownOnCleanup(t, r) // if the test stops early
	contractReleaseOnCleanup(t, h, reg)
	contractAwaitStatus(t, pool, heads, outbox.StatusInFlight, "every held head detached (IN_FLIGHT)")
	contractAwaitStatus(t, pool, free, outbox.StatusPublished, "the free aggregates published")
	return r, cancel
}

// contractShutdownWithin runs Shutdown and returns its error, failing the
// test at once if it has not returned within bound.
func contractShutdownWithin(t testing.TB, r *outbox.Relay, ctx context.Context, bound time.Duration) error {
	t.Helper()
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- r.Shutdown(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(bound):
		t.Fatalf("Shutdown still running after %s", time.Since(start))
		return nil
	}
}

// contractAssertHandedBack checks that the events are claimable at once,
// unattempted and held by nobody: PENDING, attempts 0, no owner, due, and
// not row-locked.
func contractAssertHandedBack(t testing.TB, pool *pgxpool.Pool, ids []string) {
	t.Helper()
	free := contractUnlocked(t, pool, ids)
	for _, id := range ids {
		c := contractClaimOf(t, pool, id)
		if c.Status != outbox.StatusPending || c.Attempts != 0 || c.ClaimedBy != "" || !c.Due || !free[id] {
			t.Errorf("event %s: %+v, row-lock free %v; want PENDING, 0 attempts, no owner, due, unlocked", id, c, free[id])
		}
	}
	if n := contractCountStatus(t, pool, outbox.StatusInFlight); n != 0 {
		t.Errorf("%d events left IN_FLIGHT", n)
	}
}

// contractAssertRepublished starts a fresh relay and checks that it
// publishes every event once, each aggregate in order, well before the
// visibility timeout would have released an event left IN_FLIGHT. It
// returns the fresh relay's sink.
func contractAssertRepublished(t testing.TB, pool *pgxpool.Pool, ids []string) *contractRecordingSink {
	t.Helper()
	cfg := contractConfig()
	rec := newContractRecordingSink(nil)
	contractStartRelay(t, pool, rec, cfg, "r2", nil, prometheus.NewRegistry())
	testkit.Eventually(t, cfg.InFlightTimeout/3, "every event published by a fresh relay", func() bool {
		return contractCountStatus(t, pool, outbox.StatusPublished) == len(contractRows(t, pool))
	})
	for _, id := range ids {
		if n := rec.deliveredCount(id); n != 1 {
			t.Errorf("event %s delivered %d times by the fresh relay, want 1", id, n)
		}
	}
	contractAssertAggregateOrder(t, pool, rec)
	return rec
}

// contractAssertOwnedBy checks that the events are PUBLISHED and that the
// relay named owner published them, once each: its sink, owned, delivered
// each exactly once. A published event keeps no claimed_by (its delivery
// row is deleted), so the relay that published it is told by its sink.
func contractAssertOwnedBy(t testing.TB, pool *pgxpool.Pool, ids []string, owned *contractRecordingSink, owner string) {
	t.Helper()
	for _, id := range ids {
		if c := contractClaimOf(t, pool, id); c.Status != outbox.StatusPublished || owned.deliveredCount(id) != 1 {
			t.Errorf("event %s: %+v, delivered %d times by %s; want PUBLISHED by %s, once", id, c, owned.deliveredCount(id), owner, owner)
		}
	}
}

// contractTeeSink publishes through a sink that several relays share and
// records its own successful publishes on own, so a test can tell which
// relay published an event.
type contractTeeSink struct {
	shared, own *contractRecordingSink
}

func (s contractTeeSink) Name() string { return s.shared.Name() }

func (s contractTeeSink) Publish(ctx context.Context, e outbox.Event) error {
	if err := s.shared.Publish(ctx, e); err != nil {
		return err
	}
	return s.own.Publish(ctx, e)
}

// TestContractShutdownWaitsForDetachedPublishes: Shutdown with time to spare
// waits for the detached publishes. Each records PUBLISHED by its own
// compare-and-set before Shutdown returns nil; the events behind them were
// released unattempted, and a fresh relay publishes those, nothing twice.
func TestContractShutdownWaitsForDetachedPublishes(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	heads, behind := contractHeldBacklog(t, db.Pool, "held", 3)
	free := []string{contractAppend(t, db.Pool, "free-0", "order.created"), contractAppend(t, db.Pool, "free-1", "order.created")}
	hold := newContractHold(heads, nil)
	rec := newContractRecordingSink(hold.behave)
	r, _ := contractStartDetaching(t, db.Pool, rec, hold, heads, free, prometheus.NewRegistry())

	// The held publishes return once Shutdown waits on its context, that
	// is after it stopped claiming.
	tctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sctx := &contractDoneHookCtx{Context: tctx, hook: func() { hold.letAll(nil) }}
	if err := contractShutdownWithin(t, r, sctx, 30*time.Second); err != nil {
		t.Fatalf("Shutdown with time to spare: %v, want nil", err)
	}

	// Read at once: Shutdown returns only after the outcomes are written.
	// Only r1 has run, and rec is its sink so far: a published event keeps
	// no owner or attempts, so rec tells that r1 published each head once,
	// on its first attempt.
	for _, id := range heads {
		if c := contractClaimOf(t, db.Pool, id); c.Status != outbox.StatusPublished || rec.deliveredCount(id) != 1 || rec.publishedOnAttempt(id) != 1 {
			t.Errorf("detached head %s when Shutdown returned: %+v, delivered %d times, on attempt %d; want PUBLISHED by r1, once, on attempt 1",
				id, c, rec.deliveredCount(id), rec.publishedOnAttempt(id))
		}
	}
	contractAssertHandedBack(t, db.Pool, behind) // and nothing IN_FLIGHT
	for _, id := range behind {
		if n := rec.callCount(id); n != 0 {
			t.Errorf("event %s behind a held head was handed to the sink %d times before Shutdown", id, n)
		}
	}

	// The same sink for the fresh relay: it would count a second delivery.
	// rec2 records what r2 itself publishes.
	rec2 := newContractRecordingSink(nil)
	contractStartRelay(t, db.Pool, contractTeeSink{shared: rec, own: rec2}, contractConfig(), "r2", nil, prometheus.NewRegistry())
	all := append(append(append([]string(nil), heads...), behind...), free...)
	contractAwaitStatus(t, db.Pool, all, outbox.StatusPublished, "every event published")
	for _, id := range all {
		if n := rec.deliveredCount(id); n != 1 {
			t.Errorf("event %s delivered %d times, want 1", id, n)
		}
	}
	contractAssertOwnedBy(t, db.Pool, behind, rec2, "r2")
	contractAssertAggregateOrder(t, db.Pool, rec)
}

// TestContractShutdownDeadlineHandsBackDetached: Shutdown's budget ends
// while detached publishes are held, some by a sink that honours
// cancellation and some by one that ignores it. Shutdown returns within
// its budget and the final writes' bound, with every detached event handed
// back (PENDING, attempt returned, claimable at once); a fresh relay
// publishes everything in per-aggregate order. A stuck publish that fails
// later records nothing.
func TestContractShutdownDeadlineHandsBackDetached(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	obedient, behindObedient := contractHeldBacklog(t, db.Pool, "obedient", 2)
	stuck, behindStuck := contractHeldBacklog(t, db.Pool, "stuck", 2)
	free := []string{contractAppend(t, db.Pool, "free-0", "order.created")}
	heads := append(append([]string(nil), obedient...), stuck...)
	hold := newContractHold(obedient, stuck)
	reg := prometheus.NewRegistry()
	r, _ := contractStartDetaching(t, db.Pool, newContractRecordingSink(hold.behave), hold, heads, free, reg)

	const budget = 300 * time.Millisecond
	sctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	if err := contractShutdownWithin(t, r, sctx, budget+contractStopBound); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown whose budget ended: %v, want context.DeadlineExceeded", err)
	}

	contractAssertHandedBack(t, db.Pool, heads)
	contractAssertHandedBack(t, db.Pool, append(behindObedient, behindStuck...))
	ids := append(append(append([]string(nil), heads...), behindObedient...), behindStuck...)
	rec2 := contractAssertRepublished(t, db.Pool, ids)

	// The stuck publishes fail at last: too late to record anything.
	for _, id := range stuck {
		hold.let(id, errors.New("gave up"))
	}
	contractAwaitDetachedDone(t, reg, 0)
	contractAssertOwnedBy(t, db.Pool, ids, rec2, "r2")
}

// TestContractHardStopHandsBackDetached: cancelling Start's context while
// publishes are detached (held obediently or stuck) hands every detached
// event back by itself, within the final writes' bound; a Shutdown after it
// returns nil once that is done, and a fresh relay publishes everything in
// per-aggregate order.
func TestContractHardStopHandsBackDetached(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	obedient, behindObedient := contractHeldBacklog(t, db.Pool, "obedient", 2)
	stuck, behindStuck := contractHeldBacklog(t, db.Pool, "stuck", 2)
	free := []string{contractAppend(t, db.Pool, "free-0", "order.created")}
	heads := append(append([]string(nil), obedient...), stuck...)
	hold := newContractHold(obedient, stuck)
	reg := prometheus.NewRegistry()
	r, hardStop := contractStartDetaching(t, db.Pool, newContractRecordingSink(hold.behave), hold, heads, free, reg)

	hardStop()
	testkit.Eventually(t, contractStopBound, "every detached event handed back after the hard stop", func() bool {
		for _, id := range heads {
			if contractStatusOf(t, db.Pool, id) != outbox.StatusPending {
				return false
			}
		}
		return true
	})
	if err := contractShutdownWithin(t, r, context.Background(), contractStopBound); err != nil {
		t.Errorf("Shutdown after a hard stop: %v, want nil", err)
	}

	contractAssertHandedBack(t, db.Pool, heads)
	contractAssertHandedBack(t, db.Pool, append(behindObedient, behindStuck...))
	ids := append(append(append([]string(nil), heads...), behindObedient...), behindStuck...)
	rec2 := contractAssertRepublished(t, db.Pool, ids)

	for _, id := range stuck {
		hold.let(id, errors.New("gave up"))
	}
	contractAwaitDetachedDone(t, reg, 0)
	contractAssertOwnedBy(t, db.Pool, ids, rec2, "r2")
}

// TestContractLateDetachedSuccessChangesNothing: a stuck publish that
// succeeds after Shutdown handed its event back writes nothing, whether the
// event waits PENDING or another relay holds it IN_FLIGHT meanwhile (same
// status and attempt count, another owner token): its compare-and-set
// needs its own claim.
func TestContractLateDetachedSuccessChangesNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	x := []string{contractAppend(t, db.Pool, "x", "order.created"), contractAppend(t, db.Pool, "x", "order.updated")}
	y := contractAppend(t, db.Pool, "y", "order.created")
	hold1 := newContractHold(nil, []string{x[0], y})
	reg1 := prometheus.NewRegistry()
	r1, _ := contractStartDetaching(t, db.Pool, newContractRecordingSink(hold1.behave), hold1, []string{x[0], y}, nil, reg1)

	const budget = 100 * time.Millisecond
	sctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	if err := contractShutdownWithin(t, r1, sctx, budget+contractStopBound); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown whose budget ended: %v, want context.DeadlineExceeded", err)
	}
	contractAssertHandedBack(t, db.Pool, []string{x[0], y})

	// Y's stuck publish succeeds while Y waits PENDING.
	hold1.let(y, nil)
	contractAwaitDetachedDone(t, reg1, 1)
	if c := contractClaimOf(t, db.Pool, y); c.Status != outbox.StatusPending || c.Attempts != 0 || c.ClaimedBy != "" {
		t.Errorf("handed-back event after its late success: %+v, want PENDING, 0 attempts, no owner", c)
	}

	// Another relay takes X's head over and holds it detached too.
	hold2 := newContractHold([]string{x[0]}, nil)
	rec2 := newContractRecordingSink(hold2.behave)
	reg2 := prometheus.NewRegistry()
	contractStartRelay(t, db.Pool, rec2, contractConfig(), "r2", nil, reg2)
	contractReleaseOnCleanup(t, hold2, reg2)
	contractAwaitStatus(t, db.Pool, []string{x[0]}, outbox.StatusInFlight, "X's head detached by r2")
	contractAwaitStatus(t, db.Pool, []string{y}, outbox.StatusPublished, "Y published by r2")
	taken := contractClaimOf(t, db.Pool, x[0])
	if !strings.HasPrefix(taken.ClaimedBy, "r2/") || taken.Attempts != 1 {
		t.Fatalf("X's head detached by r2: %+v, want r2's owner token and 1 attempt", taken)
	}

	// X's stuck publish in r1 succeeds now.
	hold1.let(x[0], nil)
	contractAwaitDetachedDone(t, reg1, 0)
	if c := contractClaimOf(t, db.Pool, x[0]); c != taken {
		t.Errorf("event held by r2 after r1's late success: %+v, want it unchanged: %+v", c, taken)
	}

	hold2.let(x[0], nil)
	contractAwaitStatus(t, db.Pool, x, outbox.StatusPublished, "X published by r2")
	contractAssertOwnedBy(t, db.Pool, append(x, y), rec2, "r2")
	// r2 published X's head on the attempt it detached it with, its first:
	// r1's attempt was returned at the hand-back.
	if n := rec2.publishedOnAttempt(x[0]); n != 1 {
		t.Errorf("X's head published on attempt %d, want 1 (r1's attempt returned at the hand-back)", n)
	}
	contractAssertAggregateOrder(t, db.Pool, rec2)
}
