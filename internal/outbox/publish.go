package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// A batch waits at most detach_after for its publishes. Whatever is still
// being published then is detached: the batch commits at once,
// writing each such event IN_FLIGHT under the batch's owner token with a
// visibility deadline, releasing the rest, and each detached publish
// records its outcome on its own with a compare-and-set (complete.go). So
// a slow or hung call holds back only its own aggregate, and claim
// transactions stay short, while quick publishes (nearly all of them)
// still cost one write.

// publishing is what a loop asks of the relay's publisher, chosen once
// for the sink: *publisher calls a Sink, *txPublisher writes for a TxSink
// in the claim transaction.
type publishing interface {
	// pace says what the next claim should be (pace.go).
	pace(ctx context.Context, probe, mayWait bool) (pace, bool)
	// unreserve gives back what pace reserved, when nothing was claimed.
	unreserve(pc pace)
	// publish publishes a claim and returns its outcomes, to be committed
	// by the claimer. Publishes it detached go on after it returns.
	publish(cl *claim) *outcomes
	// wait returns once every publish has ended, detached ones included.
	wait()
}

// publisher publishes claims to a Sink: different aggregates at once, up
// to max_in_flight publishes across the relay, each run in order. Its
// fields are set at construction and read-only after, except latency
// (atomic, written by every worker) and what slots, workers and the
// breaker guard themselves.
type publisher struct {
	sink       Sink
	cfg        outboxconfig.Config
	instanceID string
	policy     retryPolicy
	brk        *breaker
	rep        *reporter
	done       *completer // where detached publishes record their outcomes
	life       *lifetime
	log        *slog.Logger

	slots   *slots
	latency atomic.Int64   // moving average publish time, ns (notePublish)
	workers sync.WaitGroup // publish workers, detached ones included
}

func newPublisher(sink Sink, cfg outboxconfig.Config, instanceID string, policy retryPolicy, brk *breaker, rep *reporter, done *completer, life *lifetime, log *slog.Logger) *publisher {
	return &publisher{
		sink: sink, cfg: cfg, instanceID: instanceID, policy: policy, brk: brk, rep: rep, done: done, life: life, log: log,
		slots: newSlots(cfg.MaxInFlight),
	}
}

func (p *publisher) wait() { p.workers.Wait() }

// publish hands the claimed runs to the sink: different aggregates at
// once, up to max_in_flight publishes across the relay, each run in order,
// one event at a time. After a failure the rest of that run is left alone:
// it must not overtake the failed event. It returns the outcomes to commit
// once every publish finished, or after detach_after with the outstanding
// ones detached. It runs on the loop's goroutine, which is the one that
// may use cl.tx.
func (p *publisher) publish(cl *claim) *outcomes {
	b := &batch{
		probe:    cl.pace.probe,
		reserved: cl.pace.reserved,
		token:    fmt.Sprintf("%s/%016x", p.instanceID, rand.Uint64()),
		cutCh:    make(chan struct{}),
		cutAt:    time.Now().Add(p.cfg.DetachAfter),
		out:      outcomes{settled: make(chan struct{})},
	}
	for _, run := range cl.runs {
		b.runs = append(b.runs, &runState{events: run})
		b.events += len(run)
	}
	b.idle = sync.NewCond(&b.mu)
	if b.reserved > 0 {
		b.allStarted = make(chan struct{})
	}
	if !b.probe && b.reserved == 0 && cl.pace.sinkBound {
		b.more = make(chan struct{}, 1)
		b.latency = cl.pace.latency
	}
	// A detached publish must end before its visibility deadline
	// (in_flight_timeout after the batch commits) lets another relay
	// reclaim the event.
	ctx, cancel := context.WithDeadline(p.life.hard, cl.at.Add(p.cfg.InFlightTimeout-p.cfg.InFlightTimeout/10))
	var workers sync.WaitGroup
	for range min(len(cl.runs), p.cfg.MaxInFlight) {
		workers.Add(1)
		p.workers.Add(1)
		go func() {
			defer p.workers.Done()
			defer workers.Done()
			p.work(ctx, b, cl.skew)
		}()
	}
	done := make(chan struct{})
	go func() {
		workers.Wait()
		cancel()
		close(done)
	}()
	t := time.NewTimer(time.Until(b.cutAt))
	defer t.Stop()
	for waiting := true; waiting; {
		select {
		case <-done:
			waiting = false
		case <-t.C:
			waiting = false
		case <-b.allStarted: // nil unless pipelining for a slow sink
			waiting = false
		case <-b.more: // nil unless runs may be extended
			p.extendRuns(b, cl.tx)
		}
	}
	out := b.cutOff(p.slots)
	p.sinkWideFailure(out)
	return out
}

// work publishes runs of b until none is left or the batch is cut.
func (p *publisher) work(ctx context.Context, b *batch, skew time.Duration) {
	for run := b.take(); run != nil; run = b.take() {
		for {
			if !b.useReserved() && !p.slots.acquire(b.cutCh) {
				b.begin(run, true) // cut while waiting: hand the rest back
				return
			}
			// Once the sink is down, what has not started waits for it.
			stop := p.life.claiming.Err() != nil || (!b.probe && p.brk.open())
			ev := b.begin(run, stop)
			if ev == nil {
				p.slots.release(1)
				break
			}
			err := ev.unreadable // permanent: DEAD without reaching the sink
			start := time.Now()
			if err == nil {
				err = p.call(ctx, ev.Event)
				p.notePublish(time.Since(start))
			}
			o := p.outcome(*ev, start, err, skew, b.probe)
			p.slots.release(1)
			if b.end(run, o) {
				p.done.complete(&b.out, ev, o)
				return
			}
		}
	}
}

// call publishes ev. A sink that panics fails the publish instead of
// taking the process down with its publish slot: the event's attempts
// count, as for any failure of its own.
func (p *publisher) call(ctx context.Context, ev Event) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("outbox: sink %s panicked: %v", p.sink.Name(), v)
			p.log.Error("outbox sink panicked", "event_id", ev.EventID, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	return p.sink.Publish(ctx, ev)
}

// outcome classifies the publish of ev sent at sent; probe says it was the
// probe of an open breaker.
func (p *publisher) outcome(ev claimedRow, sent time.Time, err error, skew time.Duration, probe bool) eventOutcome {
	switch {
	case err == nil:
		p.brk.answered(sent, true)
		return eventOutcome{at: time.Now().Add(skew)}
	case p.life.hard.Err() != nil:
		return eventOutcome{handBack: true}
	case ev.unreadable != nil:
		f := p.policy.classify(ev, err) // never reached the sink: says nothing about it
		if probe {
			p.brk.probeEnded()
		}
		return eventOutcome{failed: &f}
	case IsUnavailable(err) || (!IsPermanent(err) && p.brk.sinkWide(ev.Event, err)):
		// Not the event's fault: it waits for the sink, attempts untouched.
		p.rep.unavailable(ev.Event)
		p.brk.unavailable(ev.Event, err, probe)
		return eventOutcome{handBack: true}
	default:
		p.brk.answered(sent, false)
		f := p.policy.classify(ev, err)
		return eventOutcome{failed: &f}
	}
}

// sinkWideFailure turns into hand-backs the failures of a batch that are
// the failure the breaker opened on meanwhile (breaker.sinkWide): they were
// the sink's, and must not spend their events' attempts.
func (p *publisher) sinkWideFailure(out *outcomes) {
	if !p.brk.open() {
		return
	}
	kept := out.failed[:0]
	for _, f := range out.failed {
		if IsPermanent(f.err) || f.ev.unreadable != nil || !p.brk.sinkWide(f.ev.Event, f.err) {
			kept = append(kept, f)
			continue
		}
		ev := f.ev
		out.handBack = append(out.handBack, &ev)
		p.rep.unavailable(ev.Event)
	}
	out.failed = kept
}

// extendRuns has the claim transaction lock the next events of the
// aggregates whose runs asked (batch.askMore), as many as the sink can
// take before detach_after cuts the batch, and hands them to the workers
// as new runs. Runs with nothing more are over.
func (p *publisher) extendRuns(b *batch, tx claimTxn) {
	b.mu.Lock()
	asked := b.asked
	b.asked = nil
	b.mu.Unlock()
	if len(asked) == 0 {
		return
	}
	n := max(1, int(time.Until(b.cutAt)/max(b.latency, time.Millisecond)))
	tails := make([]claimedRow, len(asked))
	for i, run := range asked {
		tails[i] = run.events[len(run.events)-1]
	}
	// A failed statement aborts the transaction, and with it the batch's
	// outcomes: bound it by the finish timeout, not by detach_after.
	ctx, cancel := context.WithTimeout(p.life.hard, finishTimeout)
	rows, err := tx.extend(ctx, tails, n)
	cancel()
	more := make(map[aggregateKey][]claimedRow, len(asked))
	for _, row := range rows {
		more[row.key()] = append(more[row.key()], row)
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	if err != nil {
		b.more = nil // the transaction is lost: extend nothing more
		if p.life.hard.Err() == nil {
			p.log.Warn("outbox batch could not extend its runs; its outcomes will not be recorded and its events will be published again", "error", err)
		}
	}
	b.extending -= len(asked)
	for _, run := range asked {
		// A new run, not more of the old one: the batch's outcomes point
		// into the old run's events.
		if evs := more[run.events[0].key()]; len(evs) > 0 {
			b.runs = append(b.runs, &runState{events: evs})
			b.events += len(evs)
		}
	}
	b.idle.Broadcast()
}
