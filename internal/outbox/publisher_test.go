package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// The publisher against a fake claimer, a fake sink and a fake completion
// store, without PostgreSQL, as River tests its producer and completer.
// Each test runs in a synctest bubble: time.Sleep moves the bubble's fake
// clock (detach_after, sink latencies) and synctest.Wait returns once every
// goroutine of the bubble is blocked, so nothing depends on real timing.

// pubTest is a publisher wired to fakes.
type pubTest struct {
	p            *publisher
	done         *completer
	store        *fakeCompletions
	brk          *breaker
	m            *metrics
	stopClaiming context.CancelFunc
	hardStop     context.CancelFunc
	seq          int64
}

func newPubTest(t *testing.T, sink Sink, cfg outboxconfig.Config) *pubTest {
	t.Helper()
	m, err := newMetrics(nil, "fake")
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	rep := &reporter{m: m, log: log}
	hard, hardStop := context.WithCancel(context.Background())
	claiming, stopClaiming := context.WithCancel(hard)
	life := &lifetime{hard: hard, claiming: claiming}
	pt := &pubTest{store: &fakeCompletions{}, m: m, stopClaiming: stopClaiming, hardStop: hardStop}
	pt.brk = newBreaker(cfg.ProbeBackoffMax, func(error) {}, func(time.Duration) {})
	pt.done = newCompleter(pt.store, rep, m, log)
	policy := retryPolicy{maxAttempts: cfg.MaxAttempts, base: cfg.BackoffBase, max: cfg.BackoffMax}
	pt.p = newPublisher(sink, cfg, "test", policy, pt.brk, rep, pt.done, life, log)
	t.Cleanup(hardStop)
	return pt
}

// claim stands in for a claimer: one run per aggregate, of the given
// lengths, paced as pc says.
func (pt *pubTest) claim(pc pace, runLens ...int) *claim {
	cl := &claim{pace: pc, at: time.Now(), tx: &fakeTxn{}}
	for i, n := range runLens {
		var run []claimedRow
		for range n {
			pt.seq++
			run = append(run, claimedRow{Event: Event{
				Seq: pt.seq, EventID: fmt.Sprintf("ev-%d", pt.seq), AggregateType: "order",
				AggregateID: fmt.Sprintf("agg-%d", i), EventType: "created",
			}, status: StatusPending})
		}
		cl.runs = append(cl.runs, run)
		cl.events += n
	}
	pt.m.claimed.Add(float64(cl.events))
	return cl
}

// publish publishes a fake claim and, as the claimer's hold does, notes
// on the outcomes how many events the claim locked.
func (pt *pubTest) publish(pc pace, runLens ...int) *outcomes {
	cl := pt.claim(pc, runLens...)
	out := pt.p.publish(cl)
	out.claimed = cl.events
	return out
}

// commit stands in for the claimer committing out (or rolling it back),
// in the order claimer.finished keeps.
func (pt *pubTest) commit(out *outcomes, committed bool) {
	pt.m.claimed.Sub(float64(out.claimed - len(out.detached)))
	if committed {
		pt.done.track(out)
	}
	out.settle(committed)
}

// fakeTxn is the claim transaction of a fake claim: extend returns what
// more holds for an aggregate, once.
type fakeTxn struct {
	mu   sync.Mutex
	more map[aggregateKey][]claimedRow
}

func (f *fakeTxn) extend(_ context.Context, tails []claimedRow, _ int) ([]claimedRow, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var rows []claimedRow
	for _, t := range tails {
		rows = append(rows, f.more[t.key()]...)
		delete(f.more, t.key())
	}
	return rows, nil
}

func (f *fakeTxn) savepoint(context.Context) (pgx.Tx, error) {
	return nil, errors.New("no savepoints in a fake claim")
}

// fakeCompletions records the completions written.
type fakeCompletions struct {
	mu      sync.Mutex
	written []*completion
}

func (s *fakeCompletions) complete(_ context.Context, group []*completion) (map[int64]bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	changed := map[int64]bool{}
	for _, c := range group {
		s.written = append(s.written, c)
		changed[c.ev.Seq] = true
	}
	return changed, nil
}

func (s *fakeCompletions) handBack(_ context.Context, group []*completion) ([]int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []int64
	for _, c := range group {
		s.written = append(s.written, c)
		ids = append(ids, c.ev.Seq)
	}
	return ids, nil
}

func (s *fakeCompletions) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.written)
}

// scriptSink answers each publish with answer (nil: at once, accepted).
type scriptSink struct {
	answer func(ctx context.Context, e Event) error
	mu     sync.Mutex
	calls  int
}

func (s *scriptSink) Name() string { return "script" }

func (s *scriptSink) called() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

func (s *scriptSink) Publish(ctx context.Context, e Event) error {
	s.mu.Lock()
	s.calls++
	s.mu.Unlock()
	if s.answer == nil {
		return nil
	}
	return s.answer(ctx, e)
}

// after answers nil after d, or the context's error.
func after(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func fakeConfig() outboxconfig.Config {
	cfg := testConfig()
	cfg.MaxInFlight = 4
	cfg.DetachAfter = 100 * time.Millisecond
	cfg.InFlightTimeout = 10 * time.Second
	return cfg
}

// TestPublisherReturnsEverySlot: whatever shape a batch takes, every
// publish slot it took, reserved ones included, is free again once its
// publishes (detached ones included) have ended.
func TestPublisherReturnsEverySlot(t *testing.T) {
	for _, tc := range []struct {
		name string
		// answer is the sink's; nil: at once.
		answer func(pt *pubTest) func(ctx context.Context, e Event) error
		// pace of the claim (probe, reserved slots); latency primes the
		// publisher's average.
		probe   bool
		latency time.Duration
		runs    []int
		check   func(t *testing.T, out *outcomes)
	}{
		{
			name: "full", runs: []int{2, 3, 1},
			check: func(t *testing.T, out *outcomes) {
				if len(out.published) != 6 || out.cutShort {
					t.Errorf("published %d, cut short %v; want all 6, not cut", len(out.published), out.cutShort)
				}
			},
		},
		{
			name: "cut", runs: []int{3, 3, 3, 3, 3, 3},
			answer: func(*pubTest) func(context.Context, Event) error {
				return func(ctx context.Context, _ Event) error { return after(ctx, 30*time.Millisecond) }
			},
			check: func(t *testing.T, out *outcomes) {
				if !out.cutShort || len(out.detached) == 0 || len(out.handBack) == 0 {
					t.Errorf("cut short %v, %d detached, %d handed back; want a cut batch with both", out.cutShort, len(out.detached), len(out.handBack))
				}
			},
		},
		{
			name: "detached", runs: []int{1, 1, 1, 1, 1, 1},
			answer: func(*pubTest) func(context.Context, Event) error {
				return func(ctx context.Context, _ Event) error { return after(ctx, time.Second) }
			},
			check: func(t *testing.T, out *outcomes) {
				if len(out.detached) != 4 || len(out.handBack) != 2 {
					t.Errorf("%d detached, %d handed back; want 4 (max_in_flight) and 2", len(out.detached), len(out.handBack))
				}
			},
		},
		{
			name: "pipelined with slots to spare", latency: time.Second, runs: []int{1, 1},
			answer: func(*pubTest) func(context.Context, Event) error {
				return func(ctx context.Context, _ Event) error { return after(ctx, time.Second) }
			},
			check: func(t *testing.T, out *outcomes) {
				if len(out.detached) != 2 {
					t.Errorf("%d detached, want both: a pipelined batch detaches once all started", len(out.detached))
				}
			},
		},
		{
			name: "probe", probe: true, runs: []int{1},
			check: func(t *testing.T, out *outcomes) {
				if len(out.published) != 1 {
					t.Errorf("probe published %d, want 1", len(out.published))
				}
			},
		},
		{
			name: "breaker opens", runs: []int{2, 2, 2, 2, 2, 2},
			answer: func(*pubTest) func(context.Context, Event) error {
				return func(context.Context, Event) error { return Unavailable(errors.New("connection refused")) }
			},
			check: func(t *testing.T, out *outcomes) {
				if len(out.failed) != 0 || len(out.published) != 0 || len(out.handBack) != 12 {
					t.Errorf("failed %d, published %d, handed back %d; want every event handed back", len(out.failed), len(out.published), len(out.handBack))
				}
			},
		},
		{
			name: "shutdown", runs: []int{3, 3, 3, 3, 3, 3},
			answer: func(pt *pubTest) func(context.Context, Event) error {
				return func(context.Context, Event) error {
					pt.stopClaiming()
					return nil
				}
			},
			check: func(t *testing.T, out *outcomes) {
				if len(out.handBack) == 0 || len(out.published)+len(out.handBack) != 18 {
					t.Errorf("published %d, handed back %d; want the rest handed back once claiming stopped", len(out.published), len(out.handBack))
				}
			},
		},
		{
			name: "hard stop", runs: []int{2, 2},
			answer: func(pt *pubTest) func(context.Context, Event) error {
				return func(ctx context.Context, _ Event) error {
					pt.hardStop()
					<-ctx.Done()
					return ctx.Err()
				}
			},
			check: func(t *testing.T, out *outcomes) {
				if len(out.handBack) != 4 || len(out.failed) != 0 {
					t.Errorf("handed back %d, failed %d; want all 4 handed back", len(out.handBack), len(out.failed))
				}
			},
		},
		{
			name: "sink panics", runs: []int{2, 2, 2},
			answer: func(*pubTest) func(context.Context, Event) error {
				return func(_ context.Context, e Event) error {
					if e.AggregateID == "agg-1" {
						panic("poisoned payload")
					}
					return nil
				}
			},
			check: func(t *testing.T, out *outcomes) {
				if len(out.failed) != 1 || len(out.published) != 4 || len(out.handBack) != 0 {
					t.Fatalf("failed %d, published %d, handed back %d; want agg-1's head failed, the other 4 published",
						len(out.failed), len(out.published), len(out.handBack))
				}
				if f := out.failed[0]; f.status != StatusFailed || f.ev.AggregateID != "agg-1" {
					t.Errorf("failure %s of %s, want FAILED of agg-1", f.status, f.ev.AggregateID)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				sink := &scriptSink{}
				pt := newPubTest(t, sink, fakeConfig())
				if tc.answer != nil {
					sink.answer = tc.answer(pt)
				}
				pt.p.latency.Store(int64(tc.latency))
				if tc.probe {
					pt.brk.unavailable(Event{AggregateType: "order", AggregateID: "other"}, Unavailable(errors.New("down")), false)
				}
				pc, ok := pt.p.pace(t.Context(), tc.probe, false)
				if !ok {
					t.Fatal("no slot free for the claim")
				}
				out := pt.publish(pc, tc.runs...)
				tc.check(t, out)
				pt.commit(out, true)
				pt.p.wait() // detached publishes end and write their outcomes
				if n := pt.p.slots.used(); n != 0 {
					t.Errorf("%d publish slots still taken after the batch and its publishes ended", n)
				}
				if n := pt.store.count(); n != len(out.detached) {
					t.Errorf("%d completions written, want one per detached publish (%d)", n, len(out.detached))
				}
				if v := testutil.ToFloat64(pt.m.claimed); v != 0 {
					t.Errorf("outbox_claimed_events %v after everything settled, want 0", v)
				}
			})
		})
	}
}

// TestPublisherSlotsHeldByDetachedPublishes: a detached publish keeps its
// slot after the batch returned, so the next claim is paced by what is
// really free; the slot comes back when the publish does.
func TestPublisherSlotsHeldByDetachedPublishes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sink := &scriptSink{answer: func(ctx context.Context, _ Event) error { return after(ctx, time.Second) }}
		pt := newPubTest(t, sink, fakeConfig())
		out := pt.publish(pace{}, 1, 1, 1)
		if n := pt.p.slots.used(); n != 3 {
			t.Errorf("%d slots taken after the cut, want the 3 detached publishes'", n)
		}
		pt.commit(out, true)
		pt.p.wait()
		if n := pt.p.slots.used(); n != 0 {
			t.Errorf("%d slots taken once the detached publishes returned, want 0", n)
		}
	})
}

// TestPublisherPaceReservesFreeSlots: for a sink slower than detach_after
// a claim reserves the free slots; when none is free the loop is told to
// let go of its claim before it waits, and what a claim does not use is
// given back.
func TestPublisherPaceReservesFreeSlots(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pt := newPubTest(t, &scriptSink{}, fakeConfig())
		pt.p.latency.Store(int64(time.Second))
		pc, ok := pt.p.pace(t.Context(), false, false)
		if !ok || pc.reserved != 4 || pc.limit != 4 {
			t.Fatalf("pace = %+v, %v; want all 4 slots reserved", pc, ok)
		}
		if _, ok := pt.p.pace(t.Context(), false, false); ok {
			t.Fatal("pace found a slot although all 4 are reserved")
		}
		waited := make(chan pace)
		go func() {
			next, _ := pt.p.pace(t.Context(), false, true)
			waited <- next
		}()
		synctest.Wait()
		pt.p.unreserve(pc) // the claim found nothing
		if next := <-waited; next.reserved != 4 {
			t.Errorf("the waiting pace reserved %d, want the 4 given back", next.reserved)
		} else {
			pt.p.unreserve(next)
		}
		if n := pt.p.slots.used(); n != 0 {
			t.Errorf("%d slots taken after both claims gave theirs back, want 0", n)
		}
	})
}

// TestDetachedOutcomeWaitsForItsClaim: a detached publish that returns
// before its batch committed writes its outcome only after the commit
// (the row is not IN_FLIGHT before), and writes nothing if the batch
// rolled back.
func TestDetachedOutcomeWaitsForItsClaim(t *testing.T) {
	for _, committed := range []bool{true, false} {
		t.Run(fmt.Sprintf("committed=%v", committed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				sink := &scriptSink{answer: func(ctx context.Context, _ Event) error { return after(ctx, 200*time.Millisecond) }}
				pt := newPubTest(t, sink, fakeConfig())
				out := pt.publish(pace{}, 1, 1)
				if len(out.detached) != 2 {
					t.Fatalf("%d detached, want 2", len(out.detached))
				}
				time.Sleep(time.Second) // the bubble's clock: the publishes return
				synctest.Wait()
				if n := sink.called(); n != 2 {
					t.Fatalf("%d publishes returned, want 2", n)
				}
				if n := pt.store.count(); n != 0 {
					t.Fatalf("%d outcomes written before the claim settled", n)
				}
				pt.commit(out, committed)
				pt.p.wait()
				want := 0
				if committed {
					want = 2
				}
				if n := pt.store.count(); n != want {
					t.Errorf("%d outcomes written after the claim settled, want %d", n, want)
				}
				for _, c := range pt.store.written {
					if c.token != out.token || c.status() != StatusPublished {
						t.Errorf("completion of %s: token %q status %s, want the batch's token and PUBLISHED", c.ev.EventID, c.token, c.status())
					}
				}
			})
		})
	}
}

// TestPublisherExtendsRunsThroughTheClaim: a sink-bound batch whose runs
// end early asks the claim transaction for more of their aggregates, and
// publishes what it returns, in order, within the same batch.
func TestPublisherExtendsRunsThroughTheClaim(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var got []string
		sink := &scriptSink{answer: func(ctx context.Context, e Event) error {
			mu.Lock()
			got = append(got, e.EventID)
			mu.Unlock()
			return after(ctx, 15*time.Millisecond)
		}}
		pt := newPubTest(t, sink, fakeConfig())
		pt.p.latency.Store(int64(15 * time.Millisecond)) // sink-bound, not slow
		pc, _ := pt.p.pace(t.Context(), false, false)
		cl := pt.claim(pc, 1)
		next := claimedRow{Event: Event{Seq: 100, EventID: "ev-next", AggregateType: "order", AggregateID: "agg-0"}}
		cl.tx = &fakeTxn{more: map[aggregateKey][]claimedRow{next.key(): {next}}}
		out := pt.p.publish(cl)
		if len(out.published) != 2 || fmt.Sprint(got) != "[ev-1 ev-next]" {
			t.Errorf("published %d: %v; want ev-1 then the extension ev-next", len(out.published), got)
		}
		pt.commit(out, true)
		pt.p.wait()
		if n := pt.p.slots.used(); n != 0 {
			t.Errorf("%d slots taken, want 0", n)
		}
	})
}
