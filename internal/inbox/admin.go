package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Operator functions behind `worker inbox` (docs/inbox.md, "Operating").
// They are plain calls over a pool; the caller prints the results.

// States, in the order of docs/inbox.md's diagram.
const (
	StateReceived         = "RECEIVED"
	StateProcessing       = "PROCESSING"
	StateFailed           = "FAILED"
	StateProcessed        = "PROCESSED"
	StateDead             = "DEAD"
	StateRecoveryRequired = "RECOVERY_REQUIRED"
	StateResolved         = "RESOLVED"
)

// AllStates are the states of inbox_message (its inbox_message_state_valid).
var AllStates = []string{StateReceived, StateProcessing, StateFailed, StateProcessed, StateDead, StateRecoveryRequired, StateResolved}

// OperatorOwner is the owner of the claims an operator's retry makes: the
// replicas' sweep takes them over at once, their lease being expired.
const OperatorOwner = "operator"

// Stats is the inbox at a glance.
type Stats struct {
	// BySource holds every source's rows by state, every state present.
	BySource map[string]map[string]int64
	// Oldest is the received_at of the oldest unfinished claim (RECEIVED,
	// PROCESSING or FAILED), OldestAge its age on the database clock and
	// OldestSource its source; zero when there is none.
	Oldest       time.Time
	OldestAge    time.Duration
	OldestSource string
}

// Sources returns the sources of s in name order.
func (s Stats) Sources() []string {
	var names []string
	for n := range s.BySource {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Total is the count of rows in state over every source.
func (s Stats) Total(state string) int64 {
	var n int64
	for _, by := range s.BySource {
		n += by[state]
	}
	return n
}

// ReadStats counts messages by source and state, and finds the oldest
// unfinished claim. sources are listed even without rows (the configured
// ones); only names those when only is set. It counts every row, so on a
// very large table it takes a while.
func ReadStats(ctx context.Context, pool *pgxpool.Pool, sources []string, only string) (Stats, error) {
	s := Stats{BySource: map[string]map[string]int64{}}
	add := func(name string) map[string]int64 {
		if by, ok := s.BySource[name]; ok {
			return by
		}
		by := map[string]int64{}
		for _, st := range AllStates {
			by[st] = 0
		}
		s.BySource[name] = by
		return by
	}
	for _, name := range sources {
		if only == "" || name == only {
			add(name)
		}
	}
	rows, err := pool.Query(ctx, `
SELECT consumer, state, count(*) FROM inbox_message
 WHERE ($1 = '' OR consumer = $1) GROUP BY consumer, state`, only)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var name, st string
		var n int64
		if err := rows.Scan(&name, &st, &n); err != nil {
			rows.Close()
			return s, err
		}
		add(name)[st] = n
	}
	if err := rows.Err(); err != nil {
		return s, err
	}
	// Unfinished rows are the few in inbox_message_lease_idx.
	var age float64
	err = pool.QueryRow(ctx, `
SELECT consumer, received_at, extract(epoch FROM now() - received_at)::float8
  FROM inbox_message WHERE finished_at IS NULL AND ($1 = '' OR consumer = $1)
 ORDER BY received_at LIMIT 1`, only).Scan(&s.OldestSource, &s.Oldest, &age)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	s.OldestAge = time.Duration(age * float64(time.Second))
	return s, err
}

// Selection names the messages an operator command acts on: the one with
// ID, or every one when ID is empty; of one source (inbox.sources[].name)
// when Source is set, and of one CloudEvents source when MsgSource is.
type Selection struct {
	Source    string
	MsgSource string
	ID        string
}

// where is the selection as SQL over $1 (Source), $2 (MsgSource) and $3
// (ID), each matching any value when empty.
const where = `($1 = '' OR consumer = $1) AND ($2 = '' OR msg_source = $2) AND ($3 = '' OR msg_id = $3)`

func (s Selection) args() []any { return []any{s.Source, s.MsgSource, s.ID} }

func (s Selection) String() string {
	var b strings.Builder
	b.WriteString("msg_id " + s.ID)
	if s.MsgSource != "" {
		b.WriteString(" from " + s.MsgSource)
	}
	if s.Source != "" {
		b.WriteString(" of source " + s.Source)
	}
	return b.String()
}

// Entry is one message as an operator sees it; EntryJSON is what the
// CLI prints of it with --output json.
type Entry struct {
	Source     string // inbox.sources[].name
	MsgSource  string // CloudEvents source, "" for a configured key
	ID         string
	State      string
	Type       string
	OrderKey   string
	Origin     string
	Headers    map[string]string
	Body       []byte
	Attempts   int
	LastError  string
	ReceivedAt time.Time
	FinishedAt time.Time // when it went DEAD or RECOVERY_REQUIRED
}

// List returns up to limit messages in state (DEAD or RECOVERY_REQUIRED),
// oldest first, and how many match in all.
func List(ctx context.Context, pool *pgxpool.Pool, state string, sel Selection, limit int) (list []Entry, total int64, err error) {
	if limit <= 0 {
		return nil, 0, fmt.Errorf("inbox: list: limit must be positive, got %d", limit)
	}
	rows, err := pool.Query(ctx, `
SELECT consumer, msg_source, msg_id, state, msg_type, order_key, origin, headers, coalesce(body, ''), attempts,
       coalesce(last_error, ''), received_at, finished_at, count(*) OVER ()
  FROM inbox_message WHERE state = $4 AND `+where+`
 ORDER BY finished_at, consumer, msg_source, msg_id LIMIT $5`, append(sel.args(), state, limit)...)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	for rows.Next() {
		var e Entry
		if err := rows.Scan(&e.Source, &e.MsgSource, &e.ID, &e.State, &e.Type, &e.OrderKey, &e.Origin, &e.Headers, &e.Body,
			&e.Attempts, &e.LastError, &e.ReceivedAt, &e.FinishedAt, &total); err != nil {
			return nil, 0, err
		}
		list = append(list, e)
	}
	return list, total, rows.Err()
}

// NotFoundError is returned when the one message a command names is not
// in the state the command acts on. Elsewhere lists the states the
// selection's messages are in instead, if any.
type NotFoundError struct {
	State     string
	Selection Selection
	Elsewhere []string
}

func (e *NotFoundError) Error() string {
	msg := fmt.Sprintf("inbox: no %s message with %s", e.State, e.Selection)
	if len(e.Elsewhere) > 0 {
		msg += " (it is " + strings.Join(e.Elsewhere, ", ") + ")"
	}
	return msg
}

// AmbiguousError is returned when a message id names several messages:
// the same id received by two sources, or from two CloudEvents sources.
type AmbiguousError struct {
	Selection Selection
	Keys      []string // source/msg_source/msg_id of each
}

func (e *AmbiguousError) Error() string {
	return fmt.Sprintf("inbox: %s names %d messages (%s)", e.Selection, len(e.Keys), strings.Join(e.Keys, ", "))
}

// UnkeyedError is returned for a retry of a message dead-lettered because
// it had no dedupe key: run again, it would still have none.
type UnkeyedError struct{ Selection Selection }

func (e *UnkeyedError) Error() string {
	return fmt.Sprintf("inbox: %s was dead-lettered without a dedupe key and cannot be retried", e.Selection)
}

// UnkeyedLeftError reports the messages a retry of every DEAD message left
// DEAD because they have no dedupe key; the others were requeued.
type UnkeyedLeftError struct{ Left int64 }

func (e *UnkeyedLeftError) Error() string {
	return fmt.Sprintf("inbox: %d DEAD message(s) left DEAD: they have no dedupe key and can only be purged", e.Left)
}

// requeue puts selected rows back to RECEIVED under an expired claim of
// the operator's: the replicas' sweep runs them from their stored body
// within inbox.lease_ttl/2. $5 resets attempts. last_error is kept for the
// record. Rows dead-lettered without a key are left alone.
const requeue = `
UPDATE inbox_message
   SET state = 'RECEIVED', owner = '` + OperatorOwner + `', lease_token = nextval('inbox_lease_token_seq'),
       lease_until = now(), finished_at = NULL, attempts = CASE WHEN $5 THEN 0 ELSE attempts END
 WHERE state = $4 AND ` + where + ` AND msg_source <> '` + unkeyedSource + `'`

// resolve closes selected RECOVERY_REQUIRED rows: an operator found the
// work done, or not needed. They are dedupe records from now on.
const resolve = `
UPDATE inbox_message SET state = 'RESOLVED', finished_at = now()
 WHERE state = $4 AND ` + where

// purge deletes selected DEAD rows for good: a redelivery of one is then
// a new message.
const purge = `DELETE FROM inbox_message WHERE state = $4 AND ` + where

// RetryDead requeues DEAD messages with their attempts reset, for the
// running replicas to process again. Messages dead-lettered for want of a
// key stay DEAD: for one such message it returns an *UnkeyedError; for
// every one, it requeues the others and returns their count with an
// *UnkeyedLeftError.
func RetryDead(ctx context.Context, pool *pgxpool.Pool, sel Selection, actor string, log *slog.Logger) (int64, error) {
	return act(ctx, pool, sel, actor, log, StateDead, "inbox dead messages requeued", requeue, true)
}

// RetryRecovery requeues RECOVERY_REQUIRED messages, attempts kept: the
// operator checked that running their work again is right.
func RetryRecovery(ctx context.Context, pool *pgxpool.Pool, sel Selection, actor string, log *slog.Logger) (int64, error) {
	return act(ctx, pool, sel, actor, log, StateRecoveryRequired, "inbox recovery messages requeued", requeue, false)
}

// ResolveRecovery marks RECOVERY_REQUIRED messages RESOLVED: the operator
// checked that their work was done, or is not needed. A redelivery is then
// a duplicate, until retention removes the record.
func ResolveRecovery(ctx context.Context, pool *pgxpool.Pool, sel Selection, actor string, log *slog.Logger) (int64, error) {
	return act(ctx, pool, sel, actor, log, StateRecoveryRequired, "inbox recovery messages resolved", resolve)
}

// PurgeDead deletes DEAD messages for good.
func PurgeDead(ctx context.Context, pool *pgxpool.Pool, sel Selection, actor string, log *slog.Logger) (int64, error) {
	return act(ctx, pool, sel, actor, log, StateDead, "inbox dead messages purged", purge)
}

// act runs one operator statement over the selected rows in state, in one
// transaction that first locks them: one message must be exactly one row.
func act(ctx context.Context, pool *pgxpool.Pool, sel Selection, actor string, log *slog.Logger,
	state, audit, stmt string, extra ...any) (n int64, err error) {
	if actor == "" {
		return 0, errors.New("inbox: actor is required (who is doing this)")
	}
	isRetry := stmt == requeue
	args := append(sel.args(), state)
	if isRetry {
		args = append(args, extra...)
	}
	var left int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		left = 0
		rows, err := tx.Query(ctx, `SELECT consumer, msg_source, msg_id, state FROM inbox_message
 WHERE `+where+` AND ($3 <> '' OR state = $4) ORDER BY 1, 2, 3 FOR UPDATE`, append(sel.args(), state)...)
		if err != nil {
			return err
		}
		var keys, elsewhere []string
		unkeyed := int64(0)
		for rows.Next() {
			var c, s, i, st string
			if err := rows.Scan(&c, &s, &i, &st); err != nil {
				rows.Close()
				return err
			}
			if st != state {
				elsewhere = append(elsewhere, st)
				continue
			}
			keys = append(keys, c+"/"+s+"/"+i)
			if s == unkeyedSource {
				unkeyed++
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		switch {
		case sel.ID != "" && len(keys) == 0:
			slices.Sort(elsewhere)
			return &NotFoundError{State: state, Selection: sel, Elsewhere: slices.Compact(elsewhere)}
		case sel.ID != "" && len(keys) > 1:
			return &AmbiguousError{Selection: sel, Keys: keys}
		case isRetry && sel.ID != "" && unkeyed > 0:
			return &UnkeyedError{Selection: sel}
		}
		tag, err := tx.Exec(ctx, stmt, args...)
		if err != nil {
			return err
		}
		n = tag.RowsAffected()
		if isRetry {
			left = unkeyed
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	if log != nil {
		attrs := []any{"job_name", "inbox", "actor", actor, "count", n}
		if sel.Source != "" {
			attrs = append(attrs, "inbox_source", sel.Source)
		}
		if sel.MsgSource != "" {
			attrs = append(attrs, "msg_source", sel.MsgSource)
		}
		if sel.ID == "" {
			attrs = append(attrs, "scope", "all")
		} else {
			attrs = append(attrs, "msg_id", sel.ID)
		}
		log.Info(audit, attrs...)
		if left > 0 {
			log.Warn("inbox dead messages left DEAD: they have no dedupe key", "job_name", "inbox", "actor", actor, "count", left)
		}
	}
	if left > 0 {
		return n, &UnkeyedLeftError{Left: left}
	}
	return n, nil
}
