package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// The ceiling of PERFORMANCE.md: the plain SQL a perfect relay would run,
// on a minimal table beside the worker's own, measured on the same rows
// right before each phase. It is the yardstick the relay's figures are
// quoted against, whatever storage the relay uses.

// ceilingTableSQL is the minimal table: the event's columns, the relay's
// state, and two partial indexes (the claim scan and the ordering gate).
const ceilingTableSQL = `
CREATE TABLE IF NOT EXISTS ceiling_event (
    id              bigint      PRIMARY KEY,
    event_id        uuid        NOT NULL,
    aggregate_type  text        COLLATE "C" NOT NULL,
    aggregate_id    text        COLLATE "C" NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL,
    occurred_at     timestamptz NOT NULL,
    status          text        NOT NULL DEFAULT 'PENDING',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz
);
CREATE INDEX IF NOT EXISTS ceiling_event_unfinished_idx ON ceiling_event (id)
    WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT');
CREATE INDEX IF NOT EXISTS ceiling_event_aggregate_idx ON ceiling_event (aggregate_type, aggregate_id, id)
    WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT')`

// ceilingSQL is the loop: claim and mark PUBLISHED in one statement, no
// ordering gate, no sink, one write per row, returning the columns a relay
// must read.
const ceilingSQL = `
UPDATE ceiling_event SET status = 'PUBLISHED', published_at = clock_timestamp(), attempts = attempts + 1
WHERE id IN (SELECT id FROM ceiling_event
             WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT') AND next_attempt_at <= now()
             ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED)
RETURNING id, event_id::text, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, attempts`

// drainCeiling loads the saved backlog table into the minimal table, then
// runs the ceiling loop on one connection until it is drained.
func drainCeiling(tb testing.TB, db *pgtest.DB, backlog string) drainResult {
	tb.Helper()
	for _, q := range []string{
		ceilingTableSQL,
		"TRUNCATE ceiling_event",
		`INSERT INTO ceiling_event (id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at)
		 SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at FROM ` + backlog,
		"VACUUM ANALYZE ceiling_event",
		"CHECKPOINT",
	} {
		exec(tb, db.Pool, q)
	}
	pool := benchPool(tb, db, "bench-ceiling", 1)
	defer pool.Close()
	cpu0 := testkit.SelfCPU(tb)
	for {
		rows, err := pool.Query(context.Background(), ceilingSQL)
		if err != nil {
			tb.Fatal(err)
		}
		n := 0
		for rows.Next() {
			var id int64
			var attempts int
			var eid, at, ai, et string
			var payload, headers []byte
			var occurred time.Time
			if err := rows.Scan(&id, &eid, &at, &ai, &et, &payload, &headers, &occurred, &attempts); err != nil {
				tb.Fatal(err)
			}
			n++
		}
		if err := rows.Err(); err != nil {
			tb.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	res := drainResult{clientCPU: testkit.SelfCPU(tb) - cpu0, dbCPU: serverCPU(tb, db, "bench-ceiling")}
	var secs float64
	err := db.Pool.QueryRow(context.Background(), `
SELECT count(*), coalesce(extract(epoch FROM max(published_at) - min(published_at)), 0)::float8
FROM ceiling_event WHERE status = 'PUBLISHED'`).Scan(&res.events, &secs)
	if err != nil {
		tb.Fatal(err)
	}
	if secs > 0 {
		res.rate = float64(res.events) / secs
	}
	exec(tb, db.Pool, "TRUNCATE ceiling_event")
	return res
}
