package outbox

import (
	"context"
	"time"
)

// The publisher paces the claims by the sink's moving average publish
// time (latency):
//
//   - A sink faster than a tenth of detach_after: a claim takes what the
//     claimer sizes (batch_size, less after batches that detach_after cut
//     short, see claimer.nextSize).
//   - A sink slower than that (sinkBound) is what bounds the drain, not
//     the claims: a batch gets through a few events per aggregate before
//     detach_after, and every aggregate the relay does not hold is a
//     publish slot's rate lost. So a claim takes one run per publish slot
//     of the loop's share of max_in_flight, each as long as a slot
//     publishes before detach_after (runLen); runs that end early are
//     extended while the batch has time (extend.go), and with several
//     loops a claim keeps its aggregates (keep.go).
//   - A sink slower than detach_after itself (slow) detaches every
//     publish. Claiming batch_size then locks events that wait for a slot
//     until detach_after hands them back, and the sizing above ratchets
//     down to one event per detach_after. So the loops pipeline: a loop
//     first reserves the free publish slots (waiting for one, holding no
//     claim and no connection, if none is free), claims that many events,
//     starts them all and detaches them as soon as they have started. Each
//     slot then goes from one publish to the next, and the relay drains at
//     about max_in_flight / latency.

// pace is the publisher's word on the next claim, taken once per batch.
type pace struct {
	probe     bool // the claim is the probe of an open breaker: one event
	limit     int  // events to claim; 0: as many as the claimer sizes
	reserved  int  // publish slots reserved for the batch (slow)
	sinkBound bool // the sink, not the claims, bounds the drain
	slow      bool // the sink is slower than detach_after: pipeline
	runLen    int  // events one slot publishes before detach_after, at least 1
	latency   time.Duration
}

// spares is how many spare heads per head a claim from a share offers
// (spareHeads): only when the relay is sink-bound.
func (pc pace) spares() int {
	if pc.sinkBound {
		return spareHeads
	}
	return 0
}

// pace returns the pace of the next claim. For a slow sink it reserves
// the free publish slots, up to batch_size; when none is free it returns
// ok false unless mayWait, and then waits for one: ok false only when ctx
// ended.
func (p *publisher) pace(ctx context.Context, probe, mayWait bool) (pace, bool) {
	lat := time.Duration(p.latency.Load())
	pc := pace{
		probe:     probe,
		sinkBound: lat > p.cfg.DetachAfter/10,
		slow:      lat > p.cfg.DetachAfter,
		runLen:    max(1, int(p.cfg.DetachAfter/max(lat, time.Microsecond))),
		latency:   lat,
	}
	switch {
	case probe:
		pc.limit = 1
	case pc.slow:
		if pc.reserved = p.slots.reserve(p.cfg.BatchSize); pc.reserved == 0 {
			if !mayWait {
				return pc, false
			}
			if pc.reserved = p.slots.reserveWait(ctx, p.cfg.BatchSize); pc.reserved == 0 {
				return pc, false
			}
		}
		pc.limit = pc.reserved
	}
	return pc, true
}

// unreserve gives back the slots pc reserved for a claim that claimed
// nothing.
func (p *publisher) unreserve(pc pace) { p.slots.release(pc.reserved) }

// notePublish folds one publish's duration into the moving average. A lost
// update between concurrent publishers only drops one sample.
func (p *publisher) notePublish(d time.Duration) {
	old := p.latency.Load()
	p.latency.Store(old + (int64(d)-old)/8)
}

// slots are the relay's publish slots: one token per publish in progress
// or reserved for one, max_in_flight in all. Workers and loops take and
// give them through the channel alone.
type slots struct{ ch chan struct{} }

func newSlots(n int) *slots { return &slots{ch: make(chan struct{}, n)} }

// acquire takes a slot, waiting for one unless cut is closed first.
func (s *slots) acquire(cut <-chan struct{}) bool {
	select {
	case s.ch <- struct{}{}:
		return true
	case <-cut:
		return false
	}
}

// reserve takes the free slots, up to n, without waiting.
func (s *slots) reserve(n int) int {
	got := 0
	for got < n {
		select {
		case s.ch <- struct{}{}:
			got++
		default:
			return got
		}
	}
	return got
}

// reserveWait waits for a slot, then takes the free ones, up to n. It
// returns 0 only when ctx ended.
func (s *slots) reserveWait(ctx context.Context, n int) int {
	select {
	case s.ch <- struct{}{}:
	case <-ctx.Done():
		return 0
	}
	return 1 + s.reserve(n-1)
}

// release gives back n slots.
func (s *slots) release(n int) {
	for range n {
		<-s.ch
	}
}

// used is how many slots are taken: publishing, or reserved.
func (s *slots) used() int { return len(s.ch) }
