package outbox

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// A batch holds its aggregates until it commits. With a sink that takes
// tens of milliseconds a publish, the runs it claimed end at different
// times, and an aggregate whose run ended sat idle, locked, until the
// slowest run of the batch ended or detach_after cut it. So while the
// batch has time left, a run that published all its events asks the loop
// for its aggregate's next ones, and the loop locks them in the batch's
// transaction: the aggregate is the batch's anyway, since its claimed
// events are unfinished and no relay takes an event behind them. The
// publisher decides when (batch.askMore, publisher.extendRuns); the claimer
// runs the statement, as it alone uses the claim transaction.

// extendSQL locks, for each aggregate ($1, $2) after event $3, its next
// unfinished events, at most $4 each, and returns those that follow one
// another: the run stops before the first event that is not due, that
// another session holds or, with block_on_dead, that follows a DEAD event.
// The rows come back in the shape of lockSQL's, none of them a head.
func extendSQL(blockOnDead bool) string {
	return withEnvelopes(`
WITH w AS MATERIALIZED (
    SELECT a.i, x.ctid AS tid, x.id
    FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS a(typ, agg, after, i)
    CROSS JOIN LATERAL (
        SELECT e.ctid, e.id FROM outbox_delivery e
        WHERE e.aggregate_type = a.typ AND e.aggregate_id = a.agg AND e.`+live+` AND e.id > a.after
        ORDER BY e.id
        LIMIT $4
    ) x
), l AS MATERIALIZED (
    SELECT `+deliveryColumns+`
    FROM outbox_delivery e
    WHERE e.ctid IN (SELECT tid FROM w) AND `+claimable+deadGateIf(blockOnDead)+`
    FOR UPDATE OF e SKIP LOCKED
)
SELECT false AS is_head, l.*, w.i FROM w JOIN l ON l.id = w.id
WHERE NOT EXISTS (SELECT 1 FROM w g WHERE g.i = w.i AND g.id < w.id AND g.id NOT IN (SELECT id FROM l))`,
		`x.i, x.id`)
}

// extend locks, in the claim transaction, the next events of the
// aggregates whose runs end with tails, at most n each: the publisher's
// extension of a sink-bound batch (publisher.extendRuns).
func (c *claimer) extend(ctx context.Context, tails []claimedRow, n int) ([]claimedRow, error) {
	types := make([]string, len(tails))
	ids := make([]string, len(tails))
	after := make([]int64, len(tails))
	for i, last := range tails {
		types[i], ids[i], after[i] = last.AggregateType, last.AggregateID, last.Seq
	}
	_, rows, err := readEvents(c.conn.Conn().Query(ctx, c.sql.extend, types, ids, after, n))
	c.m.claimed.Add(float64(len(rows)))
	c.claimed += len(rows)
	return rows, err
}

// savepoint opens a savepoint in the claim transaction, for a TxSink to
// write in (sink_tx.go).
func (c *claimer) savepoint(ctx context.Context) (pgx.Tx, error) {
	return (&claimTx{conn: c.conn.Conn()}).Begin(ctx)
}
