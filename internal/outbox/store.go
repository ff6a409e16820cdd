package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// Event states (outbox_delivery.status). PUBLISHED is not stored: a
// published event's delivery row is deleted.
const (
	StatusPending   = "PENDING"
	StatusInFlight  = "IN_FLIGHT"
	StatusPublished = "PUBLISHED"
	StatusFailed    = "FAILED"
	StatusDead      = "DEAD"
)

// allStatuses in display order.
var allStatuses = []string{StatusPending, StatusInFlight, StatusFailed, StatusDead, StatusPublished}

// The relay works on outbox_delivery, the narrow rows of the events still
// to publish (migrations/00140_outbox_storage_v2.sql), and reads each
// claimed event's envelope from outbox_event once it holds the lock. In the
// SQL below, e is a delivery row.

// live matches the partial indexes of the migration word for word, so the
// planner can prove it may use them: a row that is not DEAD.
const live = `dead_at IS NULL`

// deliveryColumns are what the lock statements return per row; withEnvelopes
// adds the envelope's.
const deliveryColumns = `e.ctid, e.id, e.created_at, e.aggregate_type, e.aggregate_id, e.attempts, e.status`

// withEnvelopes reads the envelopes of the delivery rows that rows (a
// query returning is_head, then deliveryColumns) locked, in the shape
// readEvents scans, ordered by order. One index probe each, in the one
// partition that created_at names. An envelope that is missing (a
// partition dropped by hand) comes back NULL, and the event goes DEAD.
func withEnvelopes(rows, order string) string {
	return `
SELECT x.is_head, x.ctid, x.id, v.event_id::text, x.aggregate_type, x.aggregate_id, v.event_type, v.payload,
       v.headers, v.occurred_at, x.attempts, x.status
FROM (` + rows + `) x
LEFT JOIN LATERAL (
    SELECT v.event_id, v.event_type, v.payload, v.headers, v.occurred_at FROM outbox_event v
    WHERE v.id = x.id AND v.created_at = x.created_at
) v ON true
ORDER BY ` + order
}

// claimable is rechecked on the newest version of a row when it changed
// since the statement's snapshot, so a row another relay finished or
// rescheduled meanwhile is not claimed.
const claimable = `e.` + live + ` AND e.next_attempt_at <= now()`

// deadGate holds back the events behind a DEAD event of their aggregate
// (block_on_dead). The dead index is small, so the probe is cheap.
const deadGate = `
  AND NOT EXISTS (SELECT 1 FROM outbox_delivery d
                  WHERE d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id
                    AND d.id < e.id AND d.dead_at IS NOT NULL)`

// The claim reads a window: the oldest unfinished events, without locking
// them. Because the window starts at the oldest unfinished event, an
// aggregate's first event in it IS the aggregate's head: nothing earlier of
// that aggregate is unfinished (and, thanks to the insert trigger, no
// earlier event can be hiding in an uncommitted transaction). So the
// ordering gate costs a pass over the window in the relay instead of a NOT
// EXISTS probe per row, and the claim reads the table where it is hot: the
// oldest rows, in id order.
//
// The relay then locks, by ctid, the heads it wants (SKIP LOCKED: an
// aggregate whose head another relay holds is skipped whole), and then the
// runs of the heads it got: each aggregate's later events in the window,
// up to its first event that is not due. Nobody else takes run rows, since
// a relay claims an aggregate's later events only while it holds the head.
// Locking heads first means a relay never locks events it cannot publish,
// which would block the relay that holds their head. (The gating happens in
// the relay: the same logic as one SQL statement, with GROUP BY and
// array_agg, cost three times as much server time.)
//
// Window and locks are separate statements, so separate snapshots. That is
// safe: an aggregate gains no earlier unfinished event in between (new
// events get larger ids), and the lock statements recheck each row's
// newest version, so a head another relay finished meanwhile is not claimed
// again.

// windowSQL reads the window ($1 rows).
const windowSQL = `
SELECT ctid, id, aggregate_type, aggregate_id, next_attempt_at <= now()
FROM outbox_delivery WHERE ` + live + `
ORDER BY id LIMIT $1`

// lockSQL locks a batch from the window in one statement. First up to $2
// of the candidate heads ($1), oldest first: the lazy LIMIT counts only
// heads actually locked, so heads other relays hold do not use up the
// batch. Then the runs of the heads it got: run rows ($3) are paired with
// their head ($4), and locked in id order up to $5 events in all (cutting
// by id keeps each run a prefix). Nobody else takes run rows; SKIP LOCKED
// there only guards against an operator's session holding one. The relay
// accepts a run only up to its first row that did not come back, or came
// back with another id (its slot was reused since the window was read).
// Rows come back with is_head set for heads.
func lockSQL(blockOnDead bool) string {
	return withEnvelopes(`
WITH h AS MATERIALIZED (
    SELECT `+deliveryColumns+`
    FROM outbox_delivery e
    WHERE e.ctid = ANY($1::tid[]) AND `+claimable+headGateIf(blockOnDead)+`
    ORDER BY e.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), r AS (
    SELECT `+deliveryColumns+`
    FROM outbox_delivery e
    JOIN unnest($3::tid[], $4::tid[]) AS u(tid, head) ON e.ctid = u.tid
    WHERE u.head IN (SELECT ctid FROM h) AND `+claimable+deadGateIf(blockOnDead)+`
    ORDER BY e.id
    LIMIT greatest($5 - (SELECT count(*) FROM h), 0)
    FOR UPDATE OF e SKIP LOCKED
)
SELECT true AS is_head, h.* FROM h
UNION ALL
SELECT false, r.* FROM r`, `x.is_head DESC, x.id`)
}

// aggregateHeadsSQL is the fallback when even the widest window is
// blocked: its aggregates wait for retries (or for a publish still
// outstanding), so the aggregates behind it would starve. It walks the
// aggregate index as a skip scan: one descent per aggregate, starting after
// the aggregate ($1, $2), for at most $3 aggregates, and returns each one's
// head (its oldest unfinished event) in the window's row shape. Its cost is
// bounded by the aggregates it visits, not by the backlog behind them,
// which a per-row gate would read row by row. The relay then locks the due
// heads with lockSQL, which rechecks each row.
const aggregateHeadsSQL = `
WITH RECURSIVE agg AS (
    SELECT 0 AS n, $1::text COLLATE "C" AS aggregate_type, $2::text COLLATE "C" AS aggregate_id,
           NULL::tid AS ctid, NULL::bigint AS id, NULL::boolean AS due
  UNION ALL
    SELECT a.n + 1, h.aggregate_type, h.aggregate_id, h.ctid, h.id, h.next_attempt_at <= now()
    FROM agg a CROSS JOIN LATERAL (
        SELECT e.aggregate_type, e.aggregate_id, e.ctid, e.id, e.next_attempt_at
        FROM outbox_delivery e
        WHERE e.` + live + `
          AND (e.aggregate_type, e.aggregate_id) > (a.aggregate_type, a.aggregate_id)
        ORDER BY e.aggregate_type, e.aggregate_id, e.id
        LIMIT 1
    ) h
    WHERE a.n < $3
)
SELECT ctid, id, aggregate_type, aggregate_id, due FROM agg WHERE n > 0`

func deadGateIf(blockOnDead bool) string {
	if blockOnDead {
		return deadGate
	}
	return ""
}

// predecessorGate is the classic ordering gate: no earlier unfinished event
// of the aggregate, locked or not.
const predecessorGate = `
  AND NOT EXISTS (SELECT 1 FROM outbox_delivery p
                  WHERE p.aggregate_type = e.aggregate_type AND p.aggregate_id = e.aggregate_id
                    AND p.id < e.id AND p.` + live + `)`

// headGateIf rechecks, when the heads from a window are locked, what the
// window took for granted. Without block_on_dead, nothing: new events get
// larger ids, so a head stays a head. With it, also the predecessor gate:
// an operator's retry may have turned an earlier DEAD event (which the
// window does not read) back into PENDING since the window was read.
func headGateIf(blockOnDead bool) string {
	if blockOnDead {
		return deadGate + predecessorGate
	}
	return ""
}

// The finishing statements run in the claim transaction, right before
// COMMIT: one write per event. They address rows by ctid, which cannot
// change while we hold the row locks, to skip the primary-key lookup.
// clock_timestamp(), not now(): now() is the start of a transaction that
// may have lasted the whole publish.
const (
	// Published: the delivery row goes; the envelope stays until its
	// partition is dropped.
	markPublishedSQL = `DELETE FROM outbox_delivery WHERE ctid = ANY($1::tid[])`

	// One row per failed event: its new status (FAILED or DEAD), the retry
	// delay and the error.
	markFailedSQL = `
UPDATE outbox_delivery e
SET status = f.status, attempts = e.attempts + 1,
    next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    dead_at = CASE WHEN f.status = 'DEAD' THEN clock_timestamp() END,
    last_error = f.err, claimed_by = $5
FROM unnest($1::tid[], $2::text[], $3::bigint[], $4::text[]) AS f(tid, status, delay_ms, err)
WHERE e.ctid = f.tid`

	// Claimed but not attempted: back to PENDING, attempts untouched. The
	// relay sends only rows that are not PENDING already; for those,
	// releasing the lock is the whole hand-back.
	handBackSQL = `
UPDATE outbox_delivery SET status = 'PENDING', next_attempt_at = clock_timestamp()
WHERE ctid = ANY($1::tid[])`

	// A publish still outstanding when its batch commits (detach_after):
	// the event is claimed by the batch's owner token ($3) until the
	// visibility deadline, $2 ms from now, and the attempt is counted.
	markInFlightSQL = `
UPDATE outbox_delivery
SET status = 'IN_FLIGHT', attempts = attempts + 1,
    next_attempt_at = clock_timestamp() + $2 * interval '1 millisecond', claimed_by = $3
WHERE ctid = ANY($1::tid[])`

	// The same, naming the relay's marker $4 after the token (token@id),
	// and only if this very statement sees the marker held by the relay's
	// marker session, backend $5. Otherwise it changes nothing: the rows
	// keep their state and are free again when the batch commits. A dead
	// relay's pipeline can reach the server after its marker is gone
	// (marker.go); writing its events IN_FLIGHT then, with or without the
	// marker, would hide them from the reclaim. detachLockSQL runs first in
	// the same transaction.
	markInFlightNamedSQL = `
UPDATE outbox_delivery
SET status = 'IN_FLIGHT', attempts = attempts + 1,
    next_attempt_at = clock_timestamp() + $2 * interval '1 millisecond',
    claimed_by = $3 || '@' || $4::bigint
WHERE ctid = ANY($1::tid[])
  AND EXISTS (SELECT 1` + markerHolders + ` AND l.objid::bigint = $4::bigint AND l.pid = $5::integer)`

	// detachLockSQL takes, for the rest of the claim transaction, the
	// detach lock of marker $1 in shared mode. A reclaim of that marker
	// takes it exclusively first, so it waits until no transaction that
	// may still commit events naming the marker is open (marker.go).
	detachLockSQL = `SELECT pg_advisory_xact_lock_shared(` + detachLockClass + `, $1::integer)`

	// The outcomes of detached publishes, written outside any batch, many
	// at once: one row per event with its owner token, the attempt the
	// IN_FLIGHT write counted, the new status (PUBLISHED, FAILED, DEAD, or
	// PENDING for a publish a hard stop cancelled, which gives the attempt
	// back), the retry delay and the error. Each row is a compare-and-set
	// on id, status, owner token and attempt: if the claim expired and
	// another relay took the event over, or a hard stop handed it back,
	// that row changes nothing. A PUBLISHED outcome deletes the row, the
	// others update it; each event is in one of the two. It returns the
	// ids it changed. $7 is claimed_by for the rows that stay claimed by
	// this instance. The detach may have named the relay's marker after
	// the token (token@id).
	completeSQL = `
WITH c AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::integer[], $4::text[], $5::bigint[], $6::text[])
                  AS c(id, token, attempts, status, delay_ms, err)
), published AS (
    DELETE FROM outbox_delivery e USING c
    WHERE c.status = 'PUBLISHED' AND ` + completeCAS + `
    RETURNING e.id
), other AS (
    UPDATE outbox_delivery e
    SET status = c.status,
        attempts = CASE WHEN c.status = 'PENDING' THEN e.attempts - 1 ELSE e.attempts END,
        next_attempt_at = clock_timestamp() + c.delay_ms * interval '1 millisecond',
        dead_at = CASE WHEN c.status = 'DEAD' THEN clock_timestamp() END,
        last_error = coalesce(c.err, e.last_error),
        claimed_by = CASE WHEN c.status = 'PENDING' THEN NULL ELSE $7 END
    FROM c
    WHERE c.status <> 'PUBLISHED' AND ` + completeCAS + `
    RETURNING e.id
)
SELECT id FROM published UNION ALL SELECT id FROM other`

	// Sets up the claim transaction and reads the database clock, which
	// latency is measured on. The idle timeout is the server side of the
	// visibility timeout (see claimer.open). Generic plans: the claim
	// statements take their sizes and ctids as parameters, and PostgreSQL
	// would otherwise keep planning them afresh on every call (their generic
	// plans cost more on paper than a custom plan for one call), which costs
	// more server time than running them. Their generic plans are the right
	// ones (TestStoreClaimPlansUsePartialIndexes).
	beginClaimSQL = `SELECT set_config('idle_in_transaction_session_timeout', $1, true),
       set_config('plan_cache_mode', 'force_generic_plan', true), clock_timestamp()`
)

// completeCAS is completeSQL's compare-and-set, for c's row.
const completeCAS = `e.id = c.id AND e.status = 'IN_FLIGHT' AND e.attempts = c.attempts
      AND (e.claimed_by = c.token OR starts_with(e.claimed_by, c.token || '@'))`

// claimedRow is one locked event.
type claimedRow struct {
	Event
	tid    pgtype.TID
	status string
	// unreadable says why the relay cannot publish this row (a permanent
	// error): it goes DEAD without reaching the sink. Only rows written
	// before the producer rules, or changed by hand since, can be such.
	unreadable error
}

// windowRow is one row of the window.
type windowRow struct {
	tid pgtype.TID
	id  int64
	key aggregateKey
	due bool
}

type aggregateKey struct{ typ, id string }

func (e Event) key() aggregateKey { return aggregateKey{e.AggregateType, e.AggregateID} }

// candidate is an aggregate found in the window: its head and the rest of
// its due events there, in order.
type candidate struct {
	head windowRow
	run  []windowRow
}

// readWindow scans the window rows.
func readWindow(rows pgx.Rows, err error) ([]windowRow, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []windowRow
	for rows.Next() {
		var w windowRow
		if err := rows.Scan(&w.tid, &w.id, &w.key.typ, &w.key.id, &w.due); err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, rows.Err()
}

// candidates groups the window by aggregate, oldest head first. An
// aggregate whose head is not due (a FAILED event waiting for its retry) is
// left out; a run stops at the first event that is not due.
func candidates(win []windowRow) []*candidate {
	byKey := make(map[aggregateKey]*candidate)
	var out []*candidate
	stopped := make(map[aggregateKey]bool)
	for _, w := range win {
		if stopped[w.key] {
			continue
		}
		c := byKey[w.key]
		switch {
		case !w.due:
			stopped[w.key] = true
		case c == nil:
			c = &candidate{head: w}
			byKey[w.key] = c
			out = append(out, c)
		default:
			c.run = append(c.run, w)
		}
	}
	return out
}

// readEvents scans the rows lockSQL locked into heads and run rows, which
// it tells apart by its leading is_head column.
func readEvents(rows pgx.Rows, err error) (heads, others []claimedRow, _ error) {
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var c claimedRow
		var payload, headers []byte
		var occurred pgtype.Timestamptz
		var isHead bool
		var eventID, eventType pgtype.Text
		if err := rows.Scan(&isHead, &c.tid, &c.Seq, &eventID, &c.AggregateType, &c.AggregateID, &eventType, &payload,
			&headers, &occurred, &c.Attempts, &c.status); err != nil {
			return nil, nil, err
		}
		c.EventID, c.EventType, c.Payload = eventID.String, eventType.String, payload
		// A row the relay cannot decode fails alone (it goes DEAD), never
		// the batch: the other aggregates keep flowing.
		switch h, err := decodeHeaders(headers); {
		case !eventID.Valid:
			c.unreadable = errEnvelopeMissing
		case err != nil:
			c.unreadable = Permanent(err)
		default:
			c.Headers = h
			c.OccurredAt, c.unreadable = occurredAt(occurred)
		}
		if isHead {
			heads = append(heads, c)
		} else {
			others = append(others, c)
		}
	}
	return heads, others, rows.Err()
}

// errEnvelopeMissing is the error of a delivery row whose envelope is
// gone: its partition was dropped by hand while the event was unfinished.
var errEnvelopeMissing = Permanent(errors.New("the event's envelope is missing from outbox_event: its partition was dropped before the event was published"))

// occurredAt converts a stored occurred_at. The producer rules keep it
// finite and within years 0001-9999; a row from before them, or edited by
// hand, may hold 'infinity' (which time.Time cannot hold) or a year that
// no sink can express (RFC 3339 has four digits): that is a permanent
// error for the row, not a scan error for the whole batch.
func occurredAt(ts pgtype.Timestamptz) (time.Time, error) {
	switch {
	case ts.InfinityModifier != pgtype.Finite:
		return time.Time{}, occurredAtRangeError(ts.InfinityModifier.String())
	case !inRFC3339Range(ts.Time):
		return time.Time{}, occurredAtRangeError(ts.Time.UTC().String())
	case ts.Time.IsZero():
		// Sinks take the zero time for "no time" and would leave ce-time
		// out; since 00082 the INSERT refuses it.
		return time.Time{}, Permanent(errors.New("occurred_at is 0001-01-01T00:00:00Z, the zero time, which sinks cannot tell from no time (rule outbox_event_occurred_at_not_zero)"))
	}
	return ts.Time, nil
}

// parseStringObject parses a flat JSON object whose keys and values are
// strings without escapes, as jsonb prints string headers: {"k": "v"}. It
// reports false for anything else, which the caller then hands to
// encoding/json.
func parseStringObject(b []byte) (map[string]string, bool) {
	i := 0
	space := func() {
		for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
			i++
		}
	}
	str := func() (string, bool) {
		if i >= len(b) || b[i] != '"' {
			return "", false
		}
		j := i + 1
		for j < len(b) && b[j] != '"' {
			if b[j] == '\\' || b[j] < 0x20 {
				return "", false
			}
			j++
		}
		if j >= len(b) {
			return "", false
		}
		s := string(b[i+1 : j])
		i = j + 1
		return s, true
	}
	space()
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	i++
	h := map[string]string{}
	space()
	if i < len(b) && b[i] == '}' {
		i++
		space()
		return h, i == len(b)
	}
	for {
		space()
		k, ok := str()
		if !ok {
			return nil, false
		}
		space()
		if i >= len(b) || b[i] != ':' {
			return nil, false
		}
		i++
		space()
		v, ok := str()
		if !ok {
			return nil, false
		}
		h[k] = v
		space()
		switch {
		case i < len(b) && b[i] == ',':
			i++
		case i < len(b) && b[i] == '}':
			i++
			space()
			return h, i == len(b)
		default:
			return nil, false
		}
	}
}

// decodeHeaders turns the headers object into the sink's string map.
// Non-string values (only rows from before the producer rules can have
// them) keep their JSON text, so nothing is dropped.
func decodeHeaders(b []byte) (map[string]string, error) {
	if len(b) == 0 || string(b) == "{}" {
		return nil, nil
	}
	if h, ok := parseStringObject(b); ok {
		return h, nil // the usual case, without reflection
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("outbox: headers: %w", err)
	}
	h := make(map[string]string, len(raw))
	for k, v := range raw {
		var s string
		if err := json.Unmarshal(v, &s); err == nil {
			h[k] = s
		} else {
			h[k] = string(v)
		}
	}
	return h, nil
}
