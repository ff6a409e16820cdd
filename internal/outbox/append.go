package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/tracing"
)

// NewEvent is what a producer appends. Only the first four fields are
// required; the zero value of the others picks the table default.
type NewEvent struct {
	AggregateType string
	AggregateID   string
	EventType     string
	Payload       json.RawMessage // any JSON value

	EventID    string            // uuid; default gen_random_uuid()
	Headers    map[string]string // default {}
	OccurredAt time.Time         // default now()
}

// appendSQL is the producer contract of docs/outbox.md with the optional
// columns falling back to their defaults when the helper passes NULL. A
// NULL event_id is drawn by the insert trigger.
const appendSQL = `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, event_id, headers, occurred_at)
VALUES ($1, $2, $3, $4::jsonb, $5::uuid, COALESCE($6::jsonb, '{}'), COALESCE($7::timestamptz, now()))
RETURNING event_id::text`

// Append inserts e into the outbox inside the caller's transaction, so the
// event exists exactly when the business change commits. It returns the
// event_id consumers will dedupe on. An event that breaks a producer rule
// (docs/outbox.md) is refused with a *RuleError naming the rule.
//
// Appending locks e's aggregate until tx ends (see the migration), so keep
// the transaction short after appending, and append to several aggregates in
// a consistent order.
//
// Appended inside a traced context (an inbox handler's, a job's, the
// caller's own span), the event's traceparent and tracestate headers carry
// that span's context, unless the caller set a traceparent itself: the
// relay's publish of it then continues the same trace.
func Append(ctx context.Context, tx pgx.Tx, e NewEvent) (eventID string, err error) {
	e.Headers = traceHeaders(ctx, e.Headers)
	return appendWith(e, func(args ...any) scanner { return tx.QueryRow(ctx, appendSQL, args...) })
}

// AppendStd is Append for a database/sql transaction (through pgx's
// stdlib driver or any other PostgreSQL driver), with the same rules.
func AppendStd(ctx context.Context, tx *sql.Tx, e NewEvent) (eventID string, err error) {
	e.Headers = traceHeaders(ctx, e.Headers)
	return appendWith(e, func(args ...any) scanner { return tx.QueryRowContext(ctx, appendSQL, args...) })
}

// traceHeaders is h with ctx's span context in it, unless h names its own
// traceparent.
func traceHeaders(ctx context.Context, h map[string]string) map[string]string {
	if h[tracing.Traceparent] != "" {
		return h
	}
	return tracing.Inject(ctx, h)
}

// scanner is the row that pgx and database/sql both return.
type scanner interface{ Scan(dest ...any) error }

// appendWith checks e and runs appendSQL through query.
func appendWith(e NewEvent, query func(args ...any) scanner) (eventID string, err error) {
	if err := e.validate(); err != nil {
		return "", err
	}
	var id, headers, occurred any
	if e.EventID != "" {
		id = e.EventID
	}
	if len(e.Headers) > 0 {
		b, err := json.Marshal(e.Headers)
		if err != nil {
			return "", err
		}
		headers = string(b)
	}
	if !e.OccurredAt.IsZero() {
		occurred = e.OccurredAt
	}
	err = query(e.AggregateType, e.AggregateID, e.EventType,
		string(e.Payload), id, headers, occurred).Scan(&eventID)
	return eventID, asRuleError(err)
}

// validate checks e before the round trip: the producer rules (rules.go),
// which the table enforces anyway, and a payload that is JSON.
func (e NewEvent) validate() error {
	if err := checkRules(e); err != nil {
		return err
	}
	if !json.Valid(e.Payload) {
		return errors.New("outbox: payload must be valid JSON")
	}
	return nil
}
