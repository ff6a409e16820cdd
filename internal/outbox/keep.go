package outbox

import (
	"cmp"
	"slices"
)

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
    SELECT e.ctid, e.id, e.next_attempt_at FROM outbox_delivery e
    WHERE e.aggregate_type = a.typ AND e.aggregate_id = a.agg AND e.` + live + `
    ORDER BY e.id
    LIMIT $3
) x
ORDER BY x.id`

// keep records the aggregates of a sink-bound batch, for the next claim.
func (c *claimer) keep(pc pace, runs [][]claimedRow) {
	c.kept = c.kept[:0]
	if !pc.sinkBound {
		return
	}
	for _, run := range runs {
		c.kept = append(c.kept, run[0].key())
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
