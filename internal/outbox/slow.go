package outbox

import (
	"cmp"
	"context"
	"slices"
	"time"
)

// A sink slower than detach_after detaches every publish: a batch waits
// detach_after, commits its events IN_FLIGHT and the publishes finish on
// their own. Claiming a batch of batch_size then, as for a fast sink,
// locks events that wait for a publish slot until detach_after hands them
// back; and sizing the next claim by what started (nextSize) ratchets it
// down to one event per detach_after, whatever max_in_flight allows. So
// for such a sink the loops pipeline instead: a loop first takes the
// publish slots that are free (waiting for one if none is), claims that
// many events, one per aggregate, starts them all at once and detaches
// them as soon as they have started. Each slot is then busy from one
// publish to the next, and the relay drains at about max_in_flight /
// latency.

// slowSink reports whether the sink's publishes take longer than
// detach_after, on average.
func (r *Relay) slowSink() bool {
	return time.Duration(r.latency.Load()) > r.cfg.DetachAfter
}

// A sink slower than a tenth of detach_after (sinkBound) is what bounds the
// drain, not the claims: a batch then gets through a few events per
// aggregate before detach_after, and every aggregate the relay does not
// hold is a publish slot's worth of rate lost. Sized for a fast sink
// (batch_size events, runs as long as the window shows), a claim took a
// few aggregates with runs longer than detach_after allows, which were cut
// and handed back: one replica over 200 aggregates drained a 20 ms sink at
// 0.77 of max_in_flight / latency, three replicas of one loop at 0.67. So
// a sink-bound loop claims one run per publish slot of its share of
// max_in_flight, each run as long as a slot publishes before detach_after
// (runLen), and runs that end early are extended while the batch has time
// (extend.go).

// sinkBound reports whether the sink's publishes take longer than a tenth
// of detach_after, on average.
func (r *Relay) sinkBound() bool {
	return time.Duration(r.latency.Load()) > r.cfg.DetachAfter/10
}

// runLen is how many events one publish slot gets through before
// detach_after cuts the batch, at least one.
func (r *Relay) runLen() int {
	return max(1, int(r.cfg.DetachAfter/max(time.Duration(r.latency.Load()), time.Microsecond)))
}

// sinkBoundClaim is how many events a sink-bound loop claims: a run for
// each slot of its share of max_in_flight, at most batch_size.
func (r *Relay) sinkBoundClaim() int {
	slots := (r.cfg.MaxInFlight + r.cfg.Relays - 1) / r.cfg.Relays
	return min(r.cfg.BatchSize, slots*r.runLen())
}

// spares is how many spare heads per head a claim from a share offers
// (spareHeads): only when the relay is sink-bound.
func (r *Relay) spares() int {
	if r.sinkBound() {
		return spareHeads
	}
	return 0
}

// notePublish folds one publish's duration into the moving average. A lost
// update between concurrent publishers only drops one sample.
func (r *Relay) notePublish(d time.Duration) {
	old := r.latency.Load()
	r.latency.Store(old + (int64(d)-old)/8)
}

// reserveSlots takes the free publish slots, up to batch_size, waiting for
// one when none is free, and returns how many it took: 0 only when ctx
// ended. While it waits, the loop holds no claim and no connection.
func (r *Relay) reserveSlots(ctx context.Context, st *loopState) int {
	select {
	case r.slots <- struct{}{}:
	default:
		r.settle(st)
		select {
		case r.slots <- struct{}{}:
		case <-ctx.Done():
			return 0
		}
	}
	n := 1
	for n < r.cfg.BatchSize {
		select {
		case r.slots <- struct{}{}:
			n++
		default:
			return n
		}
	}
	return n
}

// releaseSlots gives back n slots that reserveSlots took.
func (r *Relay) releaseSlots(n int) {
	for range n {
		<-r.slots
	}
}

// A sink-bound relay keeps its aggregates from one batch to the next. With
// several replicas over few aggregates, nearly every aggregate is held by
// some loop at any time, and the ones a loop's batch just committed are
// the likeliest to be free. A share, read from a window before the
// siblings' and other processes' last batches ended, mostly offered heads
// that were gone by the claim: three replicas of two loops over 200
// aggregates locked 5 runs from a share against 28 from a fresh window, for
// 32 publish slots. So a claim of a relay with several loops also reads,
// in its opening round trip, the current heads of the aggregates the
// loop's last batch held (keptHeadsSQL, an index descent each), and offers
// them to the lock statement beside the share's or the window's, oldest
// head first: an aggregate nobody holds whose head is older still goes
// first, so keeping never starves the rest.

// keptHeadsSQL returns, for each aggregate ($1, $2), its first $3
// unfinished events, in the window's row shape and id order: the first of
// each is its head, as in a window.
const keptHeadsSQL = `
SELECT x.ctid, x.id, a.typ, a.agg, x.next_attempt_at <= now()
FROM unnest($1::text[], $2::text[]) AS a(typ, agg)
CROSS JOIN LATERAL (
    SELECT e.ctid, e.id, e.next_attempt_at FROM outbox_event e
    WHERE e.aggregate_type = a.typ AND e.aggregate_id = a.agg AND e.` + unfinished + `
    ORDER BY e.id
    LIMIT $3
) x
ORDER BY x.id`

// keep records the aggregates of a sink-bound batch, for the next claim.
func (r *Relay) keep(st *loopState, runs [][]claimedRow) {
	st.kept = st.kept[:0]
	if !r.sinkBound() {
		return
	}
	for _, run := range runs {
		st.kept = append(st.kept, run[0].key())
	}
}

// withKept puts the kept aggregates' fresh candidates in place of the
// share's or window's for the same aggregates, oldest head first.
func withKept(cands, kept []*candidate) []*candidate {
	if len(kept) == 0 {
		return cands
	}
	fresh := make(map[aggregateKey]bool, len(kept))
	for _, c := range kept {
		fresh[c.head.key] = true
	}
	out := slices.DeleteFunc(slices.Clone(cands), func(c *candidate) bool { return fresh[c.head.key] })
	out = append(out, kept...)
	slices.SortFunc(out, func(a, b *candidate) int { return cmp.Compare(a.head.id, b.head.id) })
	return out
}
