package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// outageSink fails every publish with failure while down is set.
type outageSink struct {
	*contractRecordingSink
	down      atomic.Bool
	failure   func(e outbox.Event) error
	downCalls atomic.Int64 // publishes tried while down
}

func newOutageSink(failure func(e outbox.Event) error, poison func(e outbox.Event) error) *outageSink {
	s := &outageSink{failure: failure}
	s.contractRecordingSink = newContractRecordingSink(func(_ context.Context, e outbox.Event, _ int) error {
		if s.down.Load() {
			s.downCalls.Add(1)
			return s.failure(e)
		}
		if poison != nil {
			return poison(e)
		}
		return nil
	})
	return s
}

// outageConfig retries an event that failed on its own no sooner than
// the relay sees other aggregates fail: an unclassified failure is judged
// the sink's only when three aggregates fail alike, and with quick retries
// the first aggregate to fail could spend all its attempts before the
// next two aggregates had an event to fail.
func outageConfig() outboxconfig.Config {
	cfg := contractFailureConfig(false)
	cfg.BackoffBase = 500 * time.Millisecond
	cfg.BackoffMax = time.Second
	cfg.ProbeBackoffMax = 200 * time.Millisecond
	return cfg
}

// produceFor appends events over aggregates at about rate per second until
// stop is closed, and returns their event_ids in order.
func produceFor(t *testing.T, pool *pgxpool.Pool, aggregates int, every time.Duration, stop <-chan struct{}) func() []string {
	var (
		mu  sync.Mutex
		ids []string
	)
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			id := contractAppend(t, pool, fmt.Sprintf("agg-%d", i%aggregates), "order.changed")
			mu.Lock()
			ids = append(ids, id)
			mu.Unlock()
		}
	}()
	return func() []string {
		<-done
		mu.Lock()
		defer mu.Unlock()
		return ids
	}
}

// allInStatus reports whether every event of ids is in status.
func allInStatus(t *testing.T, pool *pgxpool.Pool, ids []string, status string) func() bool {
	return func() bool {
		for _, id := range ids {
			if contractStatusOf(t, pool, id) != status {
				return false
			}
		}
		return true
	}
}

// assertOrdered fails if an aggregate's deliveries (duplicates removed)
// are not in insertion order.
func assertOrdered(t *testing.T, s *contractRecordingSink) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for agg, evs := range s.byAggregate {
		seen := map[string]bool{}
		last := int64(0)
		for _, e := range evs {
			if seen[e.EventID] {
				continue
			}
			seen[e.EventID] = true
			if e.Seq < last {
				t.Errorf("aggregate %s: event seq %d delivered after seq %d", agg, e.Seq, last)
			}
			last = e.Seq
		}
	}
}

// TestContractSinkOutageHoldsEvents takes the sink down while events flow:
// nothing goes DEAD, no event spends an attempt on the outage, the sink is
// probed rather than flooded, the outage is logged once when it starts and
// once when it ends, outbox_sink_up reads 0 meanwhile, and everything that
// waited is published in per-aggregate order soon after the sink is back.
func TestContractSinkOutageHoldsEvents(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		failure func(outbox.Event) error
		spent   int // events allowed to spend an attempt on the outage
	}{
		"refused": {spent: 0, failure: func(outbox.Event) error {
			return &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
		}},
		"unavailable": {spent: 0, failure: func(e outbox.Event) error {
			return outbox.Unavailable(fmt.Errorf("event %s: 503 Service Unavailable", e.EventID))
		}},
		// A receiver answering every aggregate with the same error is
		// down, whatever status it answers with. The first two
		// aggregates to fail look like poison events and spend an
		// attempt; the third opens the breaker.
		"same error everywhere": {spent: 2, failure: func(e outbox.Event) error {
			return fmt.Errorf("event %s: 500 Internal Server Error: upstream database is down", e.EventID)
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			sink := newOutageSink(c.failure, nil)
			log, logs := contractJSONLogger(t)
			reg := prometheus.NewRegistry()
			contractStartRelay(t, db.Pool, sink, outageConfig(), "relay", log, reg)

			stop := make(chan struct{})
			produced := produceFor(t, db.Pool, 10, 10*time.Millisecond, stop)
			testkit.Eventually(t, 10*time.Second, "the first deliveries", func() bool { return sink.distinctDelivered() > 20 })

			sink.down.Store(true)
			// Every aggregate has an event waiting as the outage begins.
			var every []outbox.NewEvent
			for i := range 10 {
				every = append(every, contractNewEvent(fmt.Sprintf("agg-%d", i), "order.changed"))
			}
			burst := contractAppendInOneTx(t, db.Pool, every...)
			testkit.Eventually(t, 10*time.Second, "outbox_sink_up 0", func() bool {
				v, _ := testkit.Metric(t, reg, "outbox_sink_up", map[string]string{"sink": "contract-recorder"})
				return v == 0
			})
			// Events keep arriving while the sink is down, for more than
			// max_attempts probe rounds.
			downFor := time.Now().Add(1500 * time.Millisecond)
			testkit.Eventually(t, 10*time.Second, "the outage to last", func() bool { return time.Now().After(downFor) })
			sink.down.Store(false)
			back := time.Now()
			close(stop)
			ids := append(produced(), burst...)

			testkit.Eventually(t, 10*time.Second, "every event published", func() bool {
				return contractCountStatus(t, db.Pool, outbox.StatusPublished) == len(ids)
			})
			t.Logf("%d events, caught up %s after the sink came back, %d publishes tried while it was down",
				len(ids), time.Since(back).Round(time.Millisecond), sink.downCalls.Load())

			if n := contractCountStatus(t, db.Pool, outbox.StatusDead); n != 0 {
				t.Errorf("%d events DEAD after an outage", n)
			}
			// An event that spent an attempt on the outage was published
			// on a later attempt than its first. A published event keeps no
			// attempts, so the sink tells.
			spent := 0
			for _, r := range contractRows(t, db.Pool) {
				if n := sink.publishedOnAttempt(r.EventID); n != 1 {
					spent++
					t.Logf("event %s of %s: published on attempt %d", r.EventID, r.AggregateID, n)
				}
			}
			if spent > c.spent {
				t.Errorf("%d events spent attempts on the outage, want at most %d", spent, c.spent)
			}
			assertOrdered(t, sink.contractRecordingSink)
			// Probes, not a flood: the batch in progress when the sink went
			// down, then about one event per probe.
			if n := sink.downCalls.Load(); n > 200 {
				t.Errorf("%d publishes tried while the sink was down: the relay should probe, not retry every event", n)
			}
			if v, _ := testkit.Metric(t, reg, "outbox_sink_up", map[string]string{"sink": "contract-recorder"}); v != 1 {
				t.Errorf("outbox_sink_up = %v after the sink came back, want 1", v)
			}
			if v, _ := testkit.Metric(t, reg, "outbox_sink_breaker_opened_total", map[string]string{"sink": "contract-recorder"}); v != 1 {
				t.Errorf("outbox_sink_breaker_opened_total = %v, want 1", v)
			}
			if n := len(logs.Lines(t, "outbox sink unavailable; claiming stops, events wait with their attempts untouched, one event probes the sink until it answers")); n != 1 {
				t.Errorf("%d breaker-open lines, want 1", n)
			}
			closed := logs.Lines(t, "outbox sink available again; claiming resumes")
			if len(closed) != 1 || closed[0]["open_for"] == nil || closed[0]["events_waiting"] == nil {
				t.Errorf("breaker-close lines: %v, want one with open_for and events_waiting", closed)
			}
			// Each of those may fail until the third aggregate fails alike.
			if n, most := len(logs.Lines(t, "outbox publish failed; retry scheduled")), c.spent*(outageConfig().MaxAttempts-1); n > most {
				t.Errorf("%d per-event failure lines during an outage, want at most %d", n, most)
			}
		})
	}
}

// TestContractPoisonAggregateStillDeadLetters: an aggregate whose events
// fail on their own while the sink takes the others still goes DEAD after
// max_attempts, before, during and after an outage; the others lose
// nothing.
func TestContractPoisonAggregateStillDeadLetters(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	sink := newOutageSink(func(e outbox.Event) error {
		return outbox.Unavailable(errors.New("connection reset by peer"))
	}, func(e outbox.Event) error {
		if e.AggregateID == "poison" {
			return errors.New("500 Internal Server Error: cannot handle this order")
		}
		return nil
	})
	cfg := outageConfig()
	cfg.BackoffBase = 50 * time.Millisecond
	cfg.BackoffMax = 300 * time.Millisecond
	contractStartRelay(t, db.Pool, sink, cfg, "relay", nil, nil)

	poison := []string{contractAppend(t, db.Pool, "poison", "order.changed")}
	var healthy []string
	for i := range 30 {
		healthy = append(healthy, contractAppend(t, db.Pool, fmt.Sprintf("ok-%d", i%5), "order.changed"))
	}
	sink.down.Store(true)
	poison = append(poison, contractAppend(t, db.Pool, "poison", "order.changed"))
	for i := range 30 {
		healthy = append(healthy, contractAppend(t, db.Pool, fmt.Sprintf("ok-%d", i%5), "order.changed"))
	}
	testkit.Eventually(t, 10*time.Second, "probes while down", func() bool { return sink.downCalls.Load() > 3 })
	sink.down.Store(false)
	poison = append(poison, contractAppend(t, db.Pool, "poison", "order.changed"))

	testkit.Eventually(t, 20*time.Second, "every poison event DEAD", allInStatus(t, db.Pool, poison, outbox.StatusDead))
	testkit.Eventually(t, 10*time.Second, "every healthy event published", allInStatus(t, db.Pool, healthy, outbox.StatusPublished))
	for _, id := range poison {
		if r := contractRowOf(t, db.Pool, id); r.Attempts != cfg.MaxAttempts {
			t.Errorf("poison event %s: %d attempts, want %d (its own failures only)", id, r.Attempts, cfg.MaxAttempts)
		}
	}
	assertOrdered(t, sink.contractRecordingSink)
}

// TestContractProbesPassAnAggregateTheSinkRefusesAsUnavailable: one
// aggregate's publishes fail as the sink's would (a NATS subject no
// stream takes answers "no responders"), and its events fill the window.
// The breaker opens, and the probes go past that aggregate, behind the
// window, to another: the others publish, and the refused events wait
// with their attempts untouched. Probing the oldest head, the relay
// published nothing more.
func TestContractProbesPassAnAggregateTheSinkRefusesAsUnavailable(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	sink := newOutageSink(nil, func(e outbox.Event) error {
		if e.AggregateID == "no-stream" {
			return outbox.Unavailable(errors.New("nats: no responders available for request"))
		}
		return nil
	})
	cfg := outageConfig()
	cfg.BatchSize = 10
	contractStartRelay(t, db.Pool, sink, cfg, "relay", nil, nil)

	var refused []string
	for range 40 {
		refused = append(refused, contractAppend(t, db.Pool, "no-stream", "order.changed"))
	}
	var healthy []string
	for i := range 20 {
		healthy = append(healthy, contractAppend(t, db.Pool, fmt.Sprintf("ok-%d", i%4), "order.changed"))
	}
	testkit.Eventually(t, 20*time.Second, "every other event published", allInStatus(t, db.Pool, healthy, outbox.StatusPublished))
	for _, id := range refused {
		if r := contractRowOf(t, db.Pool, id); r.Status == outbox.StatusDead || r.Attempts != 0 {
			t.Errorf("refused event %s: %s after %d attempts, want it waiting with none spent", id, r.Status, r.Attempts)
		}
	}
	assertOrdered(t, sink.contractRecordingSink)
}

// TestContractFlappingSinkDeadLettersNothing: a sink that fails four of
// every five publishes as unavailable, for seconds, costs no event an
// attempt; everything is published in order once it steadies.
func TestContractFlappingSinkDeadLettersNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var calls atomic.Int64
	sink := newOutageSink(func(e outbox.Event) error {
		if calls.Add(1)%5 != 0 {
			return outbox.Unavailable(errors.New("connection reset by peer"))
		}
		return nil
	}, nil)
	cfg := contractFailureConfig(false) // quick retries: a counted attempt would show
	cfg.ProbeBackoffMax = 200 * time.Millisecond
	contractStartRelay(t, db.Pool, sink, cfg, "relay", nil, nil)

	sink.down.Store(true)
	var ids []string
	for i := range 60 {
		ids = append(ids, contractAppend(t, db.Pool, fmt.Sprintf("agg-%d", i%20), "order.changed"))
	}
	time.Sleep(4 * time.Second) // the flapping lasts
	if n := sink.downCalls.Load(); n < 20 {
		t.Fatalf("%d publishes while the sink flapped, want it tried", n)
	}
	sink.down.Store(false)
	testkit.Eventually(t, 10*time.Second, "every event published", allInStatus(t, db.Pool, ids, outbox.StatusPublished))
	// Published on the first attempt: the failures cost none. A published
	// event keeps no attempts, so the sink tells.
	for _, id := range ids {
		if n := sink.publishedOnAttempt(id); n != 1 {
			t.Errorf("event %s: published on attempt %d, want 1: a flapping sink must cost none", id, n)
		}
	}
	assertOrdered(t, sink.contractRecordingSink)
}

// TestContractProbeOfAnUnreadableRowEndsTheProbe: while the breaker is
// open, a probe can claim a row the relay cannot read. It goes DEAD
// without reaching the sink, which says nothing about the sink, so the
// next probe must follow. Before, that probe never ended: the loops waited
// for it for an hour, and nothing that waited for the sink was published
// after its return.
func TestContractProbeOfAnUnreadableRowEndsTheProbe(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var ids []string
	for i := range 5 {
		ids = append(ids, contractAppend(t, db.Pool, fmt.Sprintf("agg-%d", i), "order.changed"))
	}
	sink := newOutageSink(func(e outbox.Event) error {
		return outbox.Unavailable(fmt.Errorf("event %s: 503 Service Unavailable", e.EventID))
	}, nil)
	sink.down.Store(true)
	reg := prometheus.NewRegistry()
	contractStartRelay(t, db.Pool, sink, outageConfig(), "relay", contractTestLogger(t), reg)
	testkit.Eventually(t, 10*time.Second, "the breaker to open", func() bool {
		v, _ := testkit.Metric(t, reg, "outbox_sink_up", map[string]string{"sink": "contract-recorder"})
		return v == 0
	})
	// A delivery row whose envelope is gone (its partition dropped by
	// hand) cannot be published; the next probe takes it, since it is the
	// only aggregate that has not failed as unavailable.
	if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_delivery (id, created_at, aggregate_type, aggregate_id)
		VALUES (nextval('outbox_event_id_seq'), now(), 'order', 'unreadable')`); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "a probe to dead-letter the unreadable row", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusDead) == 1
	})
	if v, _ := testkit.Metric(t, reg, "outbox_sink_up", map[string]string{"sink": "contract-recorder"}); v != 0 {
		t.Fatal("the breaker closed without the sink taking an event")
	}
	sink.down.Store(false)
	testkit.Eventually(t, 5*time.Second, "the events that waited to be published", allInStatus(t, db.Pool, ids, outbox.StatusPublished))
}
