package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// A batch waits at most detach_after for its publishes. Whatever is still
// being published then is detached: the batch commits at once,
// writing each such event IN_FLIGHT under the batch's owner token with a
// visibility deadline, releasing the rest, and each detached publish
// records its outcome on its own with a compare-and-set. So a slow or hung
// call holds back only its own aggregate, and claim transactions stay
// short, while quick publishes (nearly all of them) still cost one write.

// batch is the publishing of one claimed batch: workers take its runs
// (one aggregate each) and publish each run in order, up to max_in_flight
// publishes at once across the relay.
type batch struct {
	probe bool // the single event that probes an open breaker
	runs  []*runState
	// reserved are publish slots the loop took for this batch before
	// claiming it (slow.go); its workers use them first, and cutOff gives
	// back what is left. With reserved slots the batch is cut as soon as
	// every event started: allStarted is closed then.
	reserved   int
	events     int
	allStarted chan struct{}
	token      string        // claimed_by of the events this batch detaches
	cutCh      chan struct{} // closed when the batch is cut: nothing new starts
	// more, when not nil, lets a run that published all its events ask the
	// loop for its aggregate's next ones (extend.go). A token: asked is not
	// empty.
	more    chan struct{}
	latency time.Duration // the sink's, when the batch started
	cutAt   time.Time     // when detach_after cuts the batch

	mu        sync.Mutex
	idle      *sync.Cond  // signalled when a run is added or the batch is cut
	next      int         // the next run a worker takes
	asked     []*runState // runs that published all their events and ask for more (askMore)
	extending int         // runs asked for or being extended: workers wait for them
	cut       bool
	out       outcomes
}

// runState is the progress of one run.
type runState struct {
	events   []claimedRow
	pos      int  // the event being published, or the next to start
	busy     bool // events[pos] is being published
	over     bool // nothing more of this run is published in this batch
	detached bool // events[pos] was detached while being published
}

// publish hands the claimed runs to the sink: different aggregates at
// once, up to max_in_flight publishes across the relay, each run in order,
// one event at a time. After a failure the rest of that run is left alone:
// it must not overtake the failed event. It returns the outcomes to commit
// once every publish finished, or after detach_after with the outstanding
// ones detached.
func (r *Relay) publish(conn *pgx.Conn, runs [][]claimedRow, claimedAt time.Time, skew time.Duration, probe bool, reserved int) *outcomes {
	b := &batch{
		probe:    probe,
		reserved: reserved,
		token:    fmt.Sprintf("%s/%016x", r.instanceID, rand.Uint64()),
		cutCh:    make(chan struct{}),
		cutAt:    time.Now().Add(r.cfg.DetachAfter),
		out:      outcomes{settled: make(chan struct{})},
	}
	for _, run := range runs {
		b.runs = append(b.runs, &runState{events: run})
		b.events += len(run)
	}
	b.idle = sync.NewCond(&b.mu)
	if reserved > 0 {
		b.allStarted = make(chan struct{})
	}
	if !probe && reserved == 0 && r.sinkBound() {
		b.more = make(chan struct{}, 1)
		b.latency = time.Duration(r.latency.Load())
	}
	// A detached publish must end before its visibility deadline
	// (in_flight_timeout after the batch commits) lets another relay
	// reclaim the event.
	ctx, cancel := context.WithDeadline(r.hardCtx, claimedAt.Add(r.cfg.InFlightTimeout-r.cfg.InFlightTimeout/10))
	var workers sync.WaitGroup
	for range min(len(runs), r.cfg.MaxInFlight) {
		workers.Add(1)
		r.publishers.Add(1)
		go func() {
			defer r.publishers.Done()
			defer workers.Done()
			r.work(ctx, b, skew)
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
			r.extend(conn, b)
		}
	}
	return b.cutOff(r)
}

// work publishes runs of b until none is left or the batch is cut.
func (r *Relay) work(ctx context.Context, b *batch, skew time.Duration) {
	for run := b.take(); run != nil; run = b.take() {
		for {
			if !b.useReserved() && !r.acquireSlot(b.cutCh) {
				b.begin(run, true) // cut while waiting: hand the rest back
				return
			}
			// Once the sink is down, what has not started waits for it.
			stop := r.claimCtx.Err() != nil || (!b.probe && r.sinkUp.open())
			ev := b.begin(run, stop)
			if ev == nil {
				<-r.slots
				break
			}
			err := ev.unreadable // permanent: DEAD without reaching the sink
			start := time.Now()
			if err == nil {
				err = r.sink.Publish(ctx, ev.Event)
				r.notePublish(time.Since(start))
			}
			o := r.outcome(*ev, start, err, skew, b.probe)
			<-r.slots
			if b.end(run, o) {
				r.complete(b, ev, o)
				return
			}
		}
	}
}

func (r *Relay) acquireSlot(cut <-chan struct{}) bool {
	select {
	case r.slots <- struct{}{}:
		return true
	case <-cut:
		return false
	}
}

// useReserved takes one of the batch's reserved slots, if any is left.
func (b *batch) useReserved() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.reserved == 0 {
		return false
	}
	b.reserved--
	return true
}

// take returns the next run nobody works on, or nil. While runs wait to
// be extended, it waits for them.
func (b *batch) take() *runState {
	b.mu.Lock()
	defer b.mu.Unlock()
	for !b.cut && b.next == len(b.runs) && b.extending > 0 {
		b.idle.Wait()
	}
	if b.cut || b.next == len(b.runs) {
		return nil
	}
	b.next++
	return b.runs[b.next-1]
}

// begin returns the run's next event to publish and marks it busy, or nil
// when the run is over. With stop set (claiming stopped, or the batch was
// cut), the rest of the run is handed back instead.
func (b *batch) begin(run *runState, stop bool) *claimedRow {
	b.mu.Lock()
	defer b.mu.Unlock()
	if run.over || run.pos == len(run.events) {
		if !run.over && !stop {
			b.askMore(run)
		}
		run.over = true
		return nil
	}
	if stop || b.cut {
		b.handBack(run, run.pos)
		return nil
	}
	run.busy = true
	b.out.started++
	if b.allStarted != nil && b.out.started == b.events {
		close(b.allStarted)
	}
	return &run.events[run.pos]
}

// end records the outcome of the run's busy event. It reports true when
// the event was detached meanwhile: the caller then records the outcome
// itself, after the batch committed.
func (b *batch) end(run *runState, o eventOutcome) (detached bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	run.busy = false
	if run.detached {
		return true
	}
	switch {
	case o.handBack:
		b.handBack(run, run.pos)
	case o.failed != nil:
		b.out.failed = append(b.out.failed, *o.failed)
		run.over = true // the rest of this aggregate waits
	default:
		b.out.published = append(b.out.published, &run.events[run.pos])
		b.out.at = append(b.out.at, o.at)
		run.pos++
	}
	return false
}

// handBack gives back the run's events from i on, unpublished. Called
// with b.mu held.
func (b *batch) handBack(run *runState, i int) {
	for j := i; j < len(run.events); j++ {
		b.out.handBack = append(b.out.handBack, &run.events[j])
	}
	run.over = true
}

// cutOff ends the batch: nothing new starts, the events being published
// are detached, everything not yet started is handed back and the
// reserved slots no worker took are given back. It returns the outcomes
// to commit; workers no longer touch them.
func (b *batch) cutOff(r *Relay) *outcomes {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cut = true
	close(b.cutCh)
	b.idle.Broadcast()
	r.releaseSlots(b.reserved)
	b.reserved = 0
	for _, run := range b.runs {
		if run.over {
			continue
		}
		b.out.cutShort = true
		if run.busy {
			run.detached = true
			b.out.detached = append(b.out.detached, &run.events[run.pos])
			b.handBack(run, run.pos+1)
			continue
		}
		b.handBack(run, run.pos)
	}
	b.out.token = b.token
	return &b.out
}

// eventOutcome is what one publish came to.
type eventOutcome struct {
	at       time.Time // accepted, on the database clock
	failed   *failure
	handBack bool // cancelled by a hard stop: not the sink's fault
}

// outcome classifies the publish of ev sent at sent; probe says it was the
// probe of an open breaker.
func (r *Relay) outcome(ev claimedRow, sent time.Time, err error, skew time.Duration, probe bool) eventOutcome {
	switch {
	case err == nil:
		r.sinkUp.answered(sent, true)
		return eventOutcome{at: time.Now().Add(skew)}
	case r.hardCtx.Err() != nil:
		return eventOutcome{handBack: true}
	case ev.unreadable != nil:
		f := r.classify(ev, err) // never reached the sink: says nothing about it
		if probe {
			r.sinkUp.probeEnded()
		}
		return eventOutcome{failed: &f}
	case IsUnavailable(err) || (!IsPermanent(err) && r.sinkUp.sinkWide(ev.Event, err)):
		// Not the event's fault: it waits for the sink, attempts untouched.
		r.sinkDown(ev.Event, err, probe)
		return eventOutcome{handBack: true}
	default:
		r.sinkUp.answered(sent, false)
		f := r.classify(ev, err)
		return eventOutcome{failed: &f}
	}
}

// complete records the outcome of a detached publish once its batch has
// committed the event as IN_FLIGHT, by compare-and-set (completeSQL). The
// outcomes of detached publishes that finish together are written in one
// statement: each waits while an earlier group is written, and the writer
// then takes everything that queued up meanwhile. A broker whose confirms
// take longer than detach_after detaches many publishes at once, and one
// transaction each would cost the database more than the publishes.
func (r *Relay) complete(b *batch, ev *claimedRow, o eventOutcome) {
	defer r.m.claimed.Dec()
	<-b.out.settled
	if !b.out.committed {
		return // the batch rolled back: the event was never marked, it will be published again
	}
	defer r.untrackDetached(ev)
	c := &completion{ev: ev, token: b.token, o: o, done: make(chan struct{})}
	r.completing.Lock()
	r.completions = append(r.completions, c)
	if r.writingCompletions {
		r.completing.Unlock()
		<-c.done
		return
	}
	r.writingCompletions = true
	for len(r.completions) > 0 {
		group := r.completions
		r.completions = nil
		r.completing.Unlock()
		r.writeCompletions(group)
		r.completing.Lock()
	}
	r.writingCompletions = false
	r.completing.Unlock()
}

// completion is the outcome of one detached publish, waiting to be written.
type completion struct {
	ev    *claimedRow
	token string
	o     eventOutcome
	done  chan struct{} // closed once written or given up
}

// status is the event's state the completion writes.
func (c *completion) status() string {
	switch {
	case c.o.failed != nil:
		return c.o.failed.status
	case c.o.handBack:
		return StatusPending
	default:
		return StatusPublished
	}
}

// writeCompletions writes a group of completions in one statement and
// accounts for those it changed. Losing the commit in a server crash only
// leaves the events IN_FLIGHT until their visibility deadline, then they
// are published again (at least once), so it does not wait for the WAL
// flush.
func (r *Relay) writeCompletions(group []*completion) {
	defer func() {
		for _, c := range group {
			close(c.done)
		}
	}()
	changed := map[int64]bool{}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SET LOCAL synchronous_commit = off")
	b.Queue(completeSQL, r.completeArgs(group)...).Query(func(rows pgx.Rows) error {
		var id int64
		_, err := pgx.ForEachRow(rows, []any{&id}, func() error {
			changed[id] = true
			return nil
		})
		return err
	})
	// The aggregates these events held are free again: tell the other
	// replicas' loops, which may be idle because every head was in flight.
	b.Queue("SELECT pg_notify($1, '')", NotifyChannel)
	b.Queue("COMMIT")
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	if err := r.pool.SendBatch(ctx, b).Close(); err != nil {
		for _, c := range group {
			r.log.Warn("outbox outcome of a detached publish not recorded; the event is published again after its visibility timeout",
				"event_id", c.ev.EventID, "error", err)
		}
		return
	}
	var out outcomes
	for _, c := range group {
		switch {
		case !changed[c.ev.Seq]:
			r.log.Warn("outbox claim of a detached publish expired or was handed back before its outcome; the event may be published again",
				"event_id", c.ev.EventID)
		case c.o.failed != nil:
			out.failed = append(out.failed, *c.o.failed)
		case !c.o.handBack:
			out.published = append(out.published, c.ev)
			out.at = append(out.at, c.o.at)
		}
	}
	r.record(&out)
}

// completeArgs are completeSQL's arguments for group: one array element
// per completion.
func (r *Relay) completeArgs(group []*completion) []any {
	n := len(group)
	ids, tokens, statuses, errs := make([]int64, n), make([]string, n), make([]string, n), make([]*string, n)
	attempts, delays := make([]int32, n), make([]int64, n)
	for i, c := range group {
		ids[i], tokens[i], statuses[i] = c.ev.Seq, c.token, c.status()
		attempts[i] = int32(c.ev.Attempts + 1) // the IN_FLIGHT write counted this attempt
		if f := c.o.failed; f != nil {
			delays[i] = f.delay.Milliseconds()
			e := errorText(f.err)
			errs[i] = &e
		}
	}
	return []any{ids, tokens, attempts, statuses, delays, errs, r.instanceID}
}

// trackDetached notes the events a committed batch left IN_FLIGHT, until
// their publishes record their outcomes.
func (r *Relay) trackDetached(out *outcomes) {
	r.detachedMu.Lock()
	defer r.detachedMu.Unlock()
	for _, ev := range out.detached {
		r.detached[ev] = out.token
	}
}

func (r *Relay) untrackDetached(ev *claimedRow) {
	r.detachedMu.Lock()
	defer r.detachedMu.Unlock()
	delete(r.detached, ev)
}

// handBackDetached hands back, after a hard stop, the events whose detached
// publishes have not returned: PENDING, the attempt returned, as a
// cancelled publish would record it, and by the same compare-and-set, so
// if the publish records its own outcome first, or last, the other write
// changes nothing.
func (r *Relay) handBackDetached() {
	r.detachedMu.Lock()
	outstanding := r.detached
	r.detached = map[*claimedRow]string{}
	r.detachedMu.Unlock()
	if len(outstanding) == 0 {
		return
	}
	group := make([]*completion, 0, len(outstanding))
	byID := map[int64]*claimedRow{}
	for ev, token := range outstanding {
		group = append(group, &completion{ev: ev, token: token, o: eventOutcome{handBack: true}})
		byID[ev.Seq] = ev
	}
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	rows, _ := r.pool.Query(ctx, completeSQL, r.completeArgs(group)...)
	var id int64
	_, err := pgx.ForEachRow(rows, []any{&id}, func() error {
		ev := byID[id]
		r.log.Warn("outbox detached publish still outstanding at stop; its event is handed back and will be published again",
			"event_id", ev.EventID, "aggregate_type", ev.AggregateType, "aggregate_id", ev.AggregateID)
		return nil
	})
	if err != nil {
		r.log.Warn("outbox events of outstanding detached publishes not handed back; they are published again after their visibility timeout",
			"events", len(outstanding), "error", err)
	}
}
