package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// concurrencySink records how many publishes are in progress at once, in
// all and per aggregate, and the order in which each aggregate's events
// arrive. Each call waits (briefly) until `gather` calls are in progress,
// so publishes that can overlap do.
type concurrencySink struct {
	gather int
	delay  time.Duration      // each call takes this long
	hang   func(e Event) bool // events whose call blocks until ctx ends or release closes
	// release, when closed, ends the hung calls with a transient error.
	release chan struct{}

	mu        sync.Mutex
	inFlight  int
	peak      int
	perAgg    map[string]int
	twoAtOnce []string // aggregates seen with two calls at once
	arrived   map[string][]int64
	hung      map[string]int // calls that hung, per event_id
	// The Event.Attempts of each event's successful call, per event_id:
	// the attempts its publication took, less one (a published event
	// keeps none in the outbox).
	before map[string]int
}

func newConcurrencySink(gather int) *concurrencySink {
	return &concurrencySink{
		gather: gather, release: make(chan struct{}),
		perAgg: map[string]int{}, arrived: map[string][]int64{}, hung: map[string]int{}, before: map[string]int{},
	}
}

func (s *concurrencySink) Name() string { return "concurrency" }

func (s *concurrencySink) Publish(ctx context.Context, e Event) error {
	s.mu.Lock()
	s.inFlight++
	s.peak = max(s.peak, s.inFlight)
	s.perAgg[e.AggregateID]++
	if s.perAgg[e.AggregateID] > 1 {
		s.twoAtOnce = append(s.twoAtOnce, e.AggregateID)
	}
	hang := s.hang != nil && s.hang(e)
	if hang {
		s.hung[e.EventID]++
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inFlight--
		s.perAgg[e.AggregateID]--
		s.mu.Unlock()
	}()
	if hang {
		select {
		case <-s.release:
			return errors.New("the hung call gave up")
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// Not a synchronisation: a pause that lets other publishes start, so
	// the peak shows how many the relay allows at once.
	for deadline := time.Now().Add(50 * time.Millisecond); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		s.mu.Lock()
		n := s.inFlight
		s.mu.Unlock()
		if n >= s.gather {
			break
		}
	}
	time.Sleep(s.delay) // the sink's answer time under test
	s.mu.Lock()
	s.arrived[e.AggregateID] = append(s.arrived[e.AggregateID], e.Seq)
	s.before[e.EventID] = e.Attempts
	s.mu.Unlock()
	return nil
}

func (s *concurrencySink) delivered() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, seqs := range s.arrived {
		n += len(seqs)
	}
	return n
}

// checkOrder fails the test unless every aggregate's events arrived in id
// order, each once.
func (s *concurrencySink) checkOrder(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for agg, seqs := range s.arrived {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Errorf("aggregate %s: event %d arrived after %d", agg, seqs[i], seqs[i-1])
			}
		}
	}
	if len(s.twoAtOnce) > 0 {
		t.Errorf("two publishes of one aggregate at once: %v", s.twoAtOnce)
	}
}

func appendMany(t *testing.T, db *pgtest.DB, aggregates, perAggregate int, prefix string) {
	t.Helper()
	exec(t, db.Pool, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', $1::text || (g % $2::int), 'order.updated', jsonb_build_object('g', g)
FROM generate_series(0, $2::int * $3::int - 1) g ORDER BY g`, prefix, aggregates, perAggregate)
}

// TestRelayPublishesAggregatesConcurrently: three loops share max_in_flight
// 4. Publishes of different aggregates overlap up to exactly that bound,
// never beyond it, never two of one aggregate at once, and every aggregate's
// events arrive in order.
func TestRelayPublishesAggregatesConcurrently(t *testing.T) {
	t.Parallel()
	const aggregates, perAggregate = 20, 10
	db := pgtest.New(t)
	appendMany(t, db, aggregates, perAggregate, "agg-")
	cfg := testConfig()
	cfg.Relays = 3
	cfg.MaxInFlight = 4
	sink := newConcurrencySink(cfg.MaxInFlight)
	startRelay(t, db.NewPool(t, 6), sink, cfg, nil)
	testkit.Eventually(t, 30*time.Second, "every event delivered", func() bool {
		return sink.delivered() >= aggregates*perAggregate
	})
	sink.checkOrder(t)
	if sink.delivered() != aggregates*perAggregate {
		t.Errorf("%d deliveries of %d events", sink.delivered(), aggregates*perAggregate)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if sink.peak != cfg.MaxInFlight {
		t.Errorf("at most %d publishes at once, want max_in_flight = %d", sink.peak, cfg.MaxInFlight)
	}
}

// TestRelayHungPublishHoldsBackOnlyItsAggregate: one aggregate's first
// publish hangs. Every other aggregate is published meanwhile; the hung
// event is IN_FLIGHT under this relay's claim, and its aggregate's later
// events are neither published nor handed to the sink. When the call gives
// up, the usual retry policy applies and the aggregate drains in order.
func TestRelayHungPublishHoldsBackOnlyItsAggregate(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var hungIDs []string
	for i := range 3 {
		hungIDs = append(hungIDs, appendEvent(t, db.Pool, "hung", fmt.Sprintf("hung-%d", i)))
	}
	appendMany(t, db, 10, 10, "other-")
	sink := newConcurrencySink(1)
	var once sync.Once
	sink.hang = func(e Event) bool {
		hang := false
		if e.EventID == hungIDs[0] {
			once.Do(func() { hang = true }) // only the first call
		}
		return hang
	}
	startRelay(t, db.Pool, sink, testConfig(), nil)

	testkit.Eventually(t, 30*time.Second, "every other aggregate delivered, the hung event detached", func() bool {
		return sink.delivered() == 100 && statusOf(t, db.Pool, hungIDs[0]) == StatusInFlight
	})
	var status, claimedBy string
	var attempts int
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT status, attempts, claimed_by FROM outbox_event_state WHERE event_id = $1`, hungIDs[0]).Scan(&status, &attempts, &claimedBy); err != nil {
		t.Fatal(err)
	}
	if status != StatusInFlight || attempts != 1 || claimedBy == "test-relay" {
		t.Errorf("hung event: status %s, attempts %d, claimed_by %q; want IN_FLIGHT, 1, an owner token", status, attempts, claimedBy)
	}
	for _, id := range hungIDs[1:] {
		if s := statusOf(t, db.Pool, id); s != StatusPending {
			t.Errorf("event behind the hung one: status %s, want PENDING", s)
		}
	}
	sink.mu.Lock()
	early := len(sink.arrived["hung"])
	sink.mu.Unlock()
	if early != 0 {
		t.Errorf("%d events of the hung aggregate delivered while its head hangs", early)
	}

	close(sink.release) // the call fails: a transient error, retried
	testkit.Eventually(t, 30*time.Second, "the hung aggregate drained", func() bool {
		for _, id := range hungIDs {
			if statusOf(t, db.Pool, id) != StatusPublished {
				return false
			}
		}
		return true
	})
	// A published event keeps no attempts, so the sink tells: the call
	// that published it carried one earlier attempt, the hung one.
	sink.mu.Lock()
	before, hung := sink.before[hungIDs[0]], sink.hung[hungIDs[0]]
	sink.mu.Unlock()
	if before+1 != 2 || hung != 1 {
		t.Errorf("hung event published after %d attempts (%d hung calls), want 2 (the hung one, then the retry)", before+1, hung)
	}
	sink.checkOrder(t)
}

// TestRelayDetachedOutcomeNeedsItsClaim: a detached publish whose claim
// was taken over meanwhile (another owner in claimed_by, as after an
// expired visibility deadline) records nothing when it returns.
func TestRelayDetachedOutcomeNeedsItsClaim(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	id := appendEvent(t, db.Pool, "x", "slow")
	sink := newConcurrencySink(1)
	sink.hang = func(e Event) bool { return e.EventID == id }
	reg := prometheus.NewRegistry()
	startRelay(t, db.Pool, sink, testConfig(), reg)
	testkit.Eventually(t, 10*time.Second, "the publish detached", func() bool { return statusOf(t, db.Pool, id) == StatusInFlight })
	setDelivery(t, db.Pool, id, "claimed_by = 'another-relay/1'")
	close(sink.release) // the call fails; its outcome must not be written
	// The detached publish stops counting as claimed once it is done with
	// its outcome, written or not.
	testkit.Eventually(t, 10*time.Second, "the detached publish done", func() bool {
		v, ok := testkit.Metric(t, reg, "outbox_claimed_events", nil)
		sink.mu.Lock()
		defer sink.mu.Unlock()
		return ok && v == 0 && sink.inFlight == 0
	})
	var status, claimedBy string
	var attempts int
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT status, claimed_by, attempts FROM outbox_event_state WHERE event_id = $1`, id).Scan(&status, &claimedBy, &attempts); err != nil {
		t.Fatal(err)
	}
	if status != StatusInFlight || claimedBy != "another-relay/1" || attempts != 1 {
		t.Errorf("after a taken-over claim: status %s, claimed_by %q, attempts %d; want it left IN_FLIGHT for another-relay/1, 1 attempt",
			status, claimedBy, attempts)
	}
}

// TestRelayDetachedOutcomesWrittenTogether: detached publishes that return
// together have their outcomes written in a few statements, not one each,
// and each outcome is still its own compare-and-set: published, failed
// (retry scheduled), dead, and one whose claim was taken over meanwhile,
// which stays as the new owner left it.
func TestRelayDetachedOutcomesWrittenTogether(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	const n = 40
	ids := make([]string, n)
	for i := range ids {
		ids[i] = appendEvent(t, db.Pool, fmt.Sprintf("agg-%d", i), "e")
	}
	outcome := func(e Event) error {
		switch e.EventID {
		case ids[0]:
			return Permanent(errors.New("refused for good"))
		case ids[1], ids[2], ids[3]:
			// Each its own failure: the same one for three aggregates
			// would say the sink is down (breaker.go).
			return &RetryAfterError{Err: fmt.Errorf("queue for %s full", e.AggregateID), After: time.Hour}
		}
		return nil
	}
	release := make(chan struct{})
	sink := &recorder{fail: func(ctx context.Context, e Event) error {
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return outcome(e)
	}}
	var completes atomic.Int32
	pool := db.NewPool(t, 0, func(c *pgxpool.Config) { c.ConnConfig.Tracer = queryCounter{sql: completeSQL, n: &completes} })
	startRelay(t, pool, sink, testConfig(), nil)

	inFlight := func() (n int) {
		if err := db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox_event_state WHERE status = 'IN_FLIGHT'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 10*time.Second, "every publish detached", func() bool { return inFlight() == n })
	const takenOver = "another-relay/1"
	setDelivery(t, db.Pool, ids[n-1], "claimed_by = $2", takenOver)
	close(release)
	testkit.Eventually(t, 10*time.Second, "every outcome written", func() bool {
		return inFlight() == 1
	})

	rows, err := db.Pool.Query(context.Background(),
		`SELECT event_id::text, status, coalesce(attempts, 0), coalesce(claimed_by, ''), coalesce(last_error, ''),
		        status = 'PUBLISHED', coalesce(next_attempt_at > now() + interval '1 minute', false)
		 FROM outbox_event_state`)
	if err != nil {
		t.Fatal(err)
	}
	type state struct {
		status, claimedBy, lastError string
		attempts                     int
		published, retryLater        bool
	}
	got := map[string]state{}
	for rows.Next() {
		var id string
		var s state
		if err := rows.Scan(&id, &s.status, &s.attempts, &s.claimedBy, &s.lastError, &s.published, &s.retryLater); err != nil {
			t.Fatal(err)
		}
		got[id] = s
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	delivered := map[string][]int{} // Event.Attempts of each successful publish
	for _, e := range sink.delivered() {
		delivered[e.EventID] = append(delivered[e.EventID], e.Attempts)
	}
	for i, id := range ids {
		s := got[id]
		var want state
		switch i {
		case 0:
			want = state{status: StatusDead, claimedBy: "test-relay", lastError: "permanent: refused for good", attempts: 1}
		case 1, 2, 3:
			want = state{status: StatusFailed, claimedBy: "test-relay", lastError: fmt.Sprintf("queue for agg-%d full", i), attempts: 1, retryLater: true}
		case n - 1:
			want = state{status: StatusInFlight, claimedBy: takenOver, attempts: 1}
		default:
			// The delivery row is gone, and with it the attempts: the sink
			// tells that it was published once, on its first attempt.
			want = state{status: StatusPublished, published: true}
			if d := delivered[id]; len(d) != 1 || d[0] != 0 {
				t.Errorf("event %d: delivered with earlier attempts %v, want once, with none", i, d)
			}
		}
		if s != want {
			t.Errorf("event %d: %+v, want %+v", i, s, want)
		}
	}
	if c := completes.Load(); c == 0 || c > n/4 {
		t.Errorf("%d outcomes written in %d statements, want at most %d", n, c, n/4)
	}
}

// queryCounter counts the executions of one statement on a pool, alone or
// in a batch.
type queryCounter struct {
	sql string
	n   *atomic.Int32
}

func (q queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if data.SQL == q.sql {
		q.n.Add(1)
	}
	return ctx
}

func (queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (q queryCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (q queryCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	if data.SQL == q.sql {
		q.n.Add(1)
	}
}

func (queryCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TestRelayClaimsWhatASlowSinkTakes: with a sink that takes longer per
// batch than detach_after allows, the loop claims about as many events as
// it gets to publish in that time, spread over many aggregates, instead of
// claiming batch_size events and handing most of them back unstarted each
// time. Every event still arrives, in per-aggregate order.
func TestRelayClaimsWhatASlowSinkTakes(t *testing.T) {
	t.Parallel()
	const aggregates, perAggregate = 200, 10
	db := pgtest.New(t)
	appendMany(t, db, aggregates, perAggregate, "agg-")
	sink := newConcurrencySink(1)
	sink.delay = 10 * time.Millisecond
	cfg := testConfig()
	cfg.MaxInFlight = 16
	cfg.DetachAfter = 50 * time.Millisecond // ~80 publishes of 10 ms per batch
	reg := prometheus.NewRegistry()
	startRelay(t, db.Pool, sink, cfg, reg)

	total := aggregates * perAggregate
	testkit.Eventually(t, 60*time.Second, "every event delivered", func() bool { return sink.delivered() == total })
	sink.checkOrder(t)
	// Claiming batch_size (500) every time would claim each event ~6 times
	// over; what the first batch hands back is the only waste expected.
	if claimed := testkit.HistogramSum(t, reg, "outbox_batch_size"); claimed > 1.5*float64(total) {
		t.Errorf("claimed %.0f events to publish %d: batches do not follow what the sink takes", claimed, total)
	}
}
