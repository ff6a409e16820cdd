package outbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// A batch holds its aggregates until it commits. With a sink that takes
// tens of milliseconds a publish, the runs it claimed end at different
// times, and an aggregate whose run ended sat idle, locked, until the
// slowest run of the batch ended or detach_after cut it. So while the
// batch has time left, a run that published all its events asks the loop
// for its aggregate's next ones, and the loop locks them in the batch's
// transaction: the aggregate is the batch's anyway, since its claimed
// events are unfinished and no relay takes an event behind them.

// extendSQL locks, for each aggregate ($1, $2) after event $3, its next
// unfinished events, at most $4 each, and returns those that follow one
// another: the run stops before the first event that is not due, that
// another session holds or, with block_on_dead, that follows a DEAD event.
// The rows come back in the shape of lockSQL's, none of them a head.
func extendSQL(blockOnDead bool) string {
	return `
WITH w AS MATERIALIZED (
    SELECT a.i, x.ctid AS tid, x.id
    FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS a(typ, agg, after, i)
    CROSS JOIN LATERAL (
        SELECT e.ctid, e.id FROM outbox_event e
        WHERE e.aggregate_type = a.typ AND e.aggregate_id = a.agg AND e.` + unfinished + ` AND e.id > a.after
        ORDER BY e.id
        LIMIT $4
    ) x
), l AS MATERIALIZED (
    SELECT ` + eventColumns + `
    FROM outbox_event e
    WHERE e.ctid IN (SELECT tid FROM w) AND ` + claimable + deadGateIf(blockOnDead) + `
    FOR UPDATE OF e SKIP LOCKED
)
SELECT false, l.* FROM w JOIN l ON l.id = w.id
WHERE NOT EXISTS (SELECT 1 FROM w g WHERE g.i = w.i AND g.id < w.id AND g.id NOT IN (SELECT id FROM l))
ORDER BY w.i, w.id`
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

// extend locks the next events of the aggregates whose runs asked, as
// many as the sink can take before detach_after cuts the batch, and hands
// them to the workers as new runs. Runs with nothing more are over.
func (r *Relay) extend(conn *pgx.Conn, b *batch) {
	b.mu.Lock()
	asked := b.asked
	b.asked = nil
	b.mu.Unlock()
	if len(asked) == 0 {
		return
	}
	n := max(1, int(time.Until(b.cutAt)/max(b.latency, time.Millisecond)))
	types := make([]string, len(asked))
	ids := make([]string, len(asked))
	after := make([]int64, len(asked))
	for i, run := range asked {
		last := run.events[len(run.events)-1]
		types[i], ids[i], after[i] = last.AggregateType, last.AggregateID, last.Seq
	}
	// A failed statement aborts the transaction, and with it the batch's
	// outcomes: bound it by the finish timeout, not by detach_after.
	ctx, cancel := context.WithTimeout(r.hardCtx, finishTimeout)
	_, rows, err := readEvents(conn.Query(ctx, r.extendSQL, types, ids, after, n))
	cancel()
	more := make(map[aggregateKey][]claimedRow, len(asked))
	for _, row := range rows {
		more[row.key()] = append(more[row.key()], row)
	}
	r.m.claimed.Add(float64(len(rows)))

	b.mu.Lock()
	defer b.mu.Unlock()
	if err != nil {
		b.more = nil // the transaction is lost: extend nothing more
		if r.hardCtx.Err() == nil {
			r.log.Warn("outbox batch could not extend its runs; its outcomes will not be recorded and its events will be published again", "error", err)
		}
	}
	b.extending -= len(asked)
	b.out.claimed += len(rows)
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
