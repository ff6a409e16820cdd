package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Operator functions behind the CLI. They are plain calls over a pool; the
// caller prints the results.

// Emit appends one event in its own transaction and returns its event_id.
func Emit(ctx context.Context, pool *pgxpool.Pool, e NewEvent) (eventID string, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		eventID, err = Append(ctx, tx, e)
		return err
	})
	return eventID, err
}

// Stats is the outbox at a glance.
type Stats struct {
	// Events by status; every status is present. PUBLISHED counts the
	// published events still kept, in partitions not yet dropped (purged
	// ones are not).
	ByStatus map[string]int64
	// OldestPending is the occurred_at of the oldest event not yet
	// PUBLISHED or DEAD, and OldestPendingAge its age on the database
	// clock; both zero when there is none.
	OldestPending    time.Time
	OldestPendingAge time.Duration
}

// ReadStats counts events by status and finds the oldest unfinished one. It
// counts every row, so on a very large table it takes a while.
func ReadStats(ctx context.Context, pool *pgxpool.Pool) (Stats, error) {
	s := Stats{ByStatus: map[string]int64{}}
	for _, st := range allStatuses {
		s.ByStatus[st] = 0
	}
	rows, err := pool.Query(ctx, `
SELECT status, count(*) FROM outbox_delivery GROUP BY status
UNION ALL
SELECT 'PUBLISHED', (SELECT count(*) FROM outbox_event) - (SELECT count(*) FROM outbox_delivery)
                    - (SELECT count(*) FROM outbox_purged)`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var st string
		var n int64
		if err := rows.Scan(&st, &n); err != nil {
			rows.Close()
			return s, err
		}
		s.ByStatus[st] = n
	}
	if err := rows.Err(); err != nil {
		return s, err
	}
	// An infinite occurred_at (a row from before the producer rules, which
	// the relay dead-letters) has no age: it is left out.
	var oldest *time.Time
	var age *float64
	err = pool.QueryRow(ctx, `
SELECT min(v.occurred_at), extract(epoch FROM now() - min(v.occurred_at))::float8
FROM outbox_delivery e JOIN outbox_event v ON v.id = e.id AND v.created_at = e.created_at
WHERE e.`+live+` AND isfinite(v.occurred_at)`).Scan(&oldest, &age)
	if err != nil {
		return s, err
	}
	if oldest != nil {
		s.OldestPending = *oldest
		s.OldestPendingAge = secondsToDuration(*age)
	}
	return s, nil
}

// secondsToDuration converts, saturating where a time.Duration ends
// (some 292 years): an occurred_at may lie centuries away.
func secondsToDuration(s float64) time.Duration {
	const limit = float64(math.MaxInt64) / float64(time.Second)
	switch {
	case s >= limit:
		return math.MaxInt64
	case s <= -limit:
		return math.MinInt64
	}
	return time.Duration(s * float64(time.Second))
}

// PrintStats writes s as a small table, one status per line, then the age
// of the oldest unfinished event.
func PrintStats(w io.Writer, s Stats) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STATUS\tEVENTS")
	for _, st := range allStatuses {
		fmt.Fprintf(tw, "%s\t%d\n", st, s.ByStatus[st])
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if s.OldestPending.IsZero() {
		_, err := fmt.Fprintln(w, "oldest unfinished event: none")
		return err
	}
	age := s.OldestPendingAge.Round(time.Millisecond).String()
	if s.OldestPendingAge == math.MaxInt64 {
		age = "over 292 years"
	}
	_, err := fmt.Fprintf(w, "oldest unfinished event: %s old (occurred_at %s)\n",
		age, s.OldestPending.UTC().Format(time.RFC3339))
	return err
}

// StatsJSON is `worker outbox stats --output json`; docs/operations.md
// shows it.
type StatsJSON struct {
	// ByStatus counts events by status, every status present.
	ByStatus map[string]int64 `json:"by_status"`
	// OldestUnfinished is the oldest event not yet PUBLISHED or DEAD; null
	// when there is none.
	OldestUnfinished *OldestEventJSON `json:"oldest_unfinished"`
}

// OldestEventJSON is the oldest unfinished event of StatsJSON.
type OldestEventJSON struct {
	OccurredAt time.Time `json:"occurred_at"`
	AgeSeconds float64   `json:"age_seconds"` // on the database clock
}

// JSON is s as `outbox stats --output json` prints it.
func (s Stats) JSON() StatsJSON {
	out := StatsJSON{ByStatus: s.ByStatus}
	if !s.OldestPending.IsZero() {
		out.OldestUnfinished = &OldestEventJSON{OccurredAt: s.OldestPending.UTC(), AgeSeconds: s.OldestPendingAge.Seconds()}
	}
	return out
}

// DeadEvent is one dead-lettered event.
type DeadEvent struct {
	Seq           int64
	EventID       string
	AggregateType string
	AggregateID   string
	EventType     string
	Payload       json.RawMessage
	Headers       map[string]string
	OccurredAt    time.Time
	Attempts      int
	LastError     string
	DeadAt        time.Time // when it went DEAD
}

// DeadEventJSON is one item of `worker outbox dead list --output json`;
// docs/operations.md shows it. Every key is always present.
type DeadEventJSON struct {
	Seq           int64             `json:"seq"`
	EventID       string            `json:"event_id"`
	AggregateType string            `json:"aggregate_type"`
	AggregateID   string            `json:"aggregate_id"`
	EventType     string            `json:"event_type"`
	Payload       json.RawMessage   `json:"payload"`
	Headers       map[string]string `json:"headers"`     // {} when none
	OccurredAt    *time.Time        `json:"occurred_at"` // null when unreadable (last_error says why)
	Attempts      int               `json:"attempts"`
	LastError     string            `json:"last_error"`
	DeadAt        time.Time         `json:"dead_at"`
}

// JSON is d as `outbox dead list --output json` prints it.
func (d DeadEvent) JSON() DeadEventJSON {
	out := DeadEventJSON{Seq: d.Seq, EventID: d.EventID, AggregateType: d.AggregateType, AggregateID: d.AggregateID,
		EventType: d.EventType, Payload: d.Payload, Headers: d.Headers, Attempts: d.Attempts, LastError: d.LastError,
		DeadAt: d.DeadAt.UTC()}
	if out.Headers == nil {
		out.Headers = map[string]string{}
	}
	if len(out.Payload) == 0 {
		out.Payload = json.RawMessage("null")
	}
	if !d.OccurredAt.IsZero() {
		t := d.OccurredAt.UTC()
		out.OccurredAt = &t
	}
	return out
}

// ListDead returns up to limit DEAD events, oldest first, and how many DEAD
// events there are in all.
func ListDead(ctx context.Context, pool *pgxpool.Pool, limit int) (list []DeadEvent, total int64, err error) {
	if limit <= 0 {
		return nil, 0, fmt.Errorf("outbox: list dead: limit must be positive, got %d", limit)
	}
	// The window count is taken before LIMIT, so it is the total.
	rows, err := pool.Query(ctx, `
SELECT e.id, v.event_id::text, e.aggregate_type, e.aggregate_id, v.event_type, v.payload, v.headers, v.occurred_at,
       e.attempts, coalesce(e.last_error, ''), e.dead_at, count(*) OVER ()
FROM outbox_delivery e JOIN outbox_event v ON v.id = e.id AND v.created_at = e.created_at
WHERE e.dead_at IS NOT NULL
ORDER BY e.id LIMIT $1`, limit)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	for rows.Next() {
		var d DeadEvent
		var payload, headers []byte
		var occurred pgtype.Timestamptz
		if err := rows.Scan(&d.Seq, &d.EventID, &d.AggregateType, &d.AggregateID, &d.EventType, &payload, &headers,
			&occurred, &d.Attempts, &d.LastError, &d.DeadAt, &total); err != nil {
			return nil, 0, err
		}
		d.OccurredAt, _ = occurredAt(occurred) // zero when unreadable; last_error says why
		d.Payload = payload
		if d.Headers, err = decodeHeaders(headers); err != nil {
			return nil, 0, err
		}
		list = append(list, d)
	}
	return list, total, rows.Err()
}

// ErrNotDead is returned when the one event to retry or purge is not DEAD
// (or does not exist).
var ErrNotDead = errors.New("outbox: no DEAD event with that event_id")

// deadSelected picks the DEAD delivery rows an admin statement acts on:
// all, or the one whose envelope has event_id $1.
const deadSelected = `dead_at IS NOT NULL
  AND ($1::uuid IS NULL OR id IN (SELECT id FROM outbox_event WHERE event_id = $1::uuid))`

const retryDeadSQL = `
UPDATE outbox_delivery
SET status = 'PENDING', attempts = 0, next_attempt_at = now(), claimed_by = NULL, dead_at = NULL
WHERE ` + deadSelected

// RetryDead puts DEAD events back to PENDING with their attempts reset, so
// the relay publishes them again; last_error is kept for the record. It
// acts on one event (eventID) or, when eventID is empty, on every DEAD
// event, logs who did it (actor) and returns how many it requeued.
//
// With block_on_dead=false later events of the aggregate may already be
// published, so a retried event reaches consumers after them.
func RetryDead(ctx context.Context, pool *pgxpool.Pool, eventID, actor string, log *slog.Logger) (int64, error) {
	n, err := deadAdmin(ctx, pool, retryDeadSQL, eventID, actor)
	if err != nil {
		return 0, err
	}
	logAdmin(log, "outbox dead events requeued", eventID, actor, n)
	return n, nil
}

// PurgeDead gives up on DEAD events for good: one (eventID) or, when
// eventID is empty, every DEAD event. Their delivery rows go, so their
// partitions can be dropped; a row in outbox_purged tells them from
// published events until then. It logs who did it and returns how many it
// purged.
func PurgeDead(ctx context.Context, pool *pgxpool.Pool, eventID, actor string, log *slog.Logger) (int64, error) {
	const purge = `
WITH gone AS (DELETE FROM outbox_delivery WHERE ` + deadSelected + ` RETURNING id, created_at, last_error)
INSERT INTO outbox_purged (id, created_at, last_error) SELECT id, created_at, last_error FROM gone`
	n, err := deadAdmin(ctx, pool, purge, eventID, actor)
	if err != nil {
		return 0, err
	}
	logAdmin(log, "outbox dead events purged", eventID, actor, n)
	return n, nil
}

func deadAdmin(ctx context.Context, pool *pgxpool.Pool, sql, eventID, actor string) (int64, error) {
	if actor == "" {
		return 0, errors.New("outbox: actor is required (who is doing this)")
	}
	var id any
	if eventID != "" {
		id = eventID
	}
	var n int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sql, id)
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "22P02" {
				return fmt.Errorf("outbox: event_id %q is not a uuid", eventID)
			}
			return err
		}
		n = tag.RowsAffected()
		// Requeued rows wake the relays like new ones (a no-op for purge).
		_, err = tx.Exec(ctx, "SELECT pg_notify($1, '')", NotifyChannel)
		return err
	})
	if err != nil {
		return 0, err
	}
	if n == 0 && eventID != "" {
		return 0, ErrNotDead
	}
	return n, nil
}

func logAdmin(log *slog.Logger, msg, eventID, actor string, n int64) {
	if log == nil {
		return
	}
	attrs := []any{"job", RelayJobName, "actor", actor, "count", n}
	if eventID == "" {
		attrs = append(attrs, "scope", "all")
	} else {
		attrs = append(attrs, "event_id", eventID)
	}
	log.Info(msg, attrs...)
}
