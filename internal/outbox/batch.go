package outbox

import (
	"sync"
	"time"
)

// batch is the publishing of one claimed batch: workers take its runs
// (one aggregate each) and publish each run in order, up to max_in_flight
// publishes at once across the relay. The loop's goroutine (publish,
// extendRuns) and the batch's workers share it under mu; the fields above
// mu are set before the workers start.
type batch struct {
	probe bool // the single event that probes an open breaker
	// allStarted, for a batch with reserved slots, is closed once every
	// event started: such a batch is cut then.
	allStarted chan struct{}
	token      string        // claimed_by of the events this batch detaches
	cutCh      chan struct{} // closed when the batch is cut: nothing new starts
	latency    time.Duration // the sink's, when the batch was paced
	cutAt      time.Time     // when detach_after cuts the batch

	mu sync.Mutex
	// reserved are publish slots the loop took for this batch before
	// claiming it (pace.go); its workers use them first, and cutOff gives
	// back what is left.
	reserved int
	events   int
	runs     []*runState
	// more, when not nil, lets a run that published all its events ask the
	// loop for its aggregate's next ones (extendRuns). A token: asked is
	// not empty. Only the loop's goroutine sets it (to nil, under mu) and
	// receives from it; workers send under mu.
	more      chan struct{}
	idle      *sync.Cond  // signalled when a run is added or the batch is cut
	next      int         // the next run a worker takes
	asked     []*runState // runs that published all their events and ask for more (askMore)
	extending int         // runs asked for or being extended: workers wait for them
	cut       bool
	out       outcomes
}

// runState is the progress of one run. Guarded by its batch's mu.
type runState struct {
	events   []claimedRow
	pos      int  // the event being published, or the next to start
	busy     bool // events[pos] is being published
	over     bool // nothing more of this run is published in this batch
	detached bool // events[pos] was detached while being published
}

// eventOutcome is what one publish came to.
type eventOutcome struct {
	at       time.Time // accepted, on the database clock
	failed   *failure
	handBack bool // cancelled by a hard stop, or the sink is down: not the event's fault
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

// askMore queues run, which published all its events, for its aggregate's
// next ones, if the batch has time left for one more publish. Called with
// b.mu held.
func (b *batch) askMore(run *runState) {
	if b.more == nil || b.cut || time.Until(b.cutAt) < b.latency {
		return
	}
	b.asked = append(b.asked, run)
	b.extending++
	select {
	case b.more <- struct{}{}:
	default: // the loop has been told already
	}
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
func (b *batch) cutOff(s *slots) *outcomes {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cut = true
	close(b.cutCh)
	b.idle.Broadcast()
	s.release(b.reserved)
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
