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
	ByStatus map[string]int64 // rows by status; every status is present
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
	rows, err := pool.Query(ctx, `SELECT status, count(*) FROM outbox_event GROUP BY status`)
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
SELECT min(occurred_at), extract(epoch FROM now() - min(occurred_at))::float8
FROM outbox_event WHERE `+unfinished+` AND isfinite(occurred_at)`).Scan(&oldest, &age)
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

// ListDead returns up to limit DEAD events, oldest first, and how many DEAD
// events there are in all.
func ListDead(ctx context.Context, pool *pgxpool.Pool, limit int) (list []DeadEvent, total int64, err error) {
	if limit <= 0 {
		return nil, 0, fmt.Errorf("outbox: list dead: limit must be positive, got %d", limit)
	}
	// next_attempt_at of a DEAD row is when it was marked dead. The window
	// count is taken before LIMIT, so it is the total.
	rows, err := pool.Query(ctx, `
SELECT id, event_id::text, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at,
       attempts, coalesce(last_error, ''), next_attempt_at, count(*) OVER ()
FROM outbox_event WHERE status = 'DEAD'
ORDER BY id LIMIT $1`, limit)
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

// RulesLeftError reports DEAD events that RetryDead left DEAD because they
// break a producer rule (rows written before the rules existed): requeued,
// they would only go DEAD again. Purge them instead.
type RulesLeftError struct{ Left int64 }

func (e *RulesLeftError) Error() string {
	return fmt.Sprintf("outbox: %d DEAD event(s) left DEAD: they break a producer rule and can only be purged", e.Left)
}

const retryDeadSQL = `
UPDATE outbox_event
SET status = 'PENDING', attempts = 0, next_attempt_at = now(), claimed_by = NULL
WHERE status = 'DEAD' AND ($1::uuid IS NULL OR event_id = $1::uuid)`

// RetryDead puts DEAD events back to PENDING with their attempts reset, so
// the relay publishes them again; last_error is kept for the record. It
// acts on one event (eventID) or, when eventID is empty, on every DEAD
// event, logs who did it (actor) and returns how many it requeued.
//
// Resetting attempts subjects a row to the producer rules again, so an
// event that breaks one cannot be requeued: for one event RetryDead returns
// the *RuleError; for all, it requeues the others and returns their count
// with a *RulesLeftError.
//
// With block_on_dead=false later events of the aggregate may already be
// published, so a retried event reaches consumers after them.
func RetryDead(ctx context.Context, pool *pgxpool.Pool, eventID, actor string, log *slog.Logger) (int64, error) {
	n, err := deadAdmin(ctx, pool, retryDeadSQL, eventID, actor)
	var left int64
	var re *RuleError
	if eventID == "" && errors.As(err, &re) {
		n, left, err = retryDeadOneByOne(ctx, pool)
	}
	if err != nil {
		return 0, err
	}
	logAdmin(log, "outbox dead events requeued", eventID, actor, n)
	if left > 0 {
		if log != nil {
			log.Warn("outbox dead events left DEAD: they break a producer rule", "job", RelayJobName, "actor", actor, "count", left)
		}
		return n, &RulesLeftError{Left: left}
	}
	return n, nil
}

// retryDeadOneByOne requeues every DEAD event that the producer rules
// allow, each under its own savepoint, and counts the ones they refuse. It
// is the slow path of RetryDead, taken only when some row breaks a rule.
func retryDeadOneByOne(ctx context.Context, pool *pgxpool.Pool) (requeued, left int64, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, "SELECT event_id::text FROM outbox_event WHERE status = 'DEAD' ORDER BY id")
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, id := range ids {
			err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
				_, err := sp.Exec(ctx, retryDeadSQL, id)
				return asRuleError(err)
			})
			var re *RuleError
			switch {
			case errors.As(err, &re):
				left++
			case err != nil:
				return err
			default:
				requeued++
			}
		}
		_, err = tx.Exec(ctx, "SELECT pg_notify($1, '')", NotifyChannel)
		return err
	})
	return requeued, left, err
}

// PurgeDead deletes DEAD events for good: one (eventID) or, when eventID is
// empty, every DEAD event. It logs who did it and returns how many it
// deleted.
func PurgeDead(ctx context.Context, pool *pgxpool.Pool, eventID, actor string, log *slog.Logger) (int64, error) {
	const purge = `DELETE FROM outbox_event WHERE status = 'DEAD' AND ($1::uuid IS NULL OR event_id = $1::uuid)`
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
			return asRuleError(err)
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
