// Package outbox is the producer side and the sink port of the worker's
// transactional outbox.
//
// A producer calls Append (pgx) or AppendStd (database/sql) inside its own
// business transaction: the event exists exactly when the business change
// commits, and the worker's relay publishes it afterwards, at least once
// and in order per aggregate. Producers in other languages INSERT into
// outbox_event directly (docs/outbox.md); the rules are the same.
//
// A custom sink implements Sink and is added to an embedding program with
// worker.WithSink. Its errors say what went wrong: Permanent (the event can
// never be published), Unavailable (the sink is down; no event spends an
// attempt), RetryAfterError (retry no sooner than After); any other error
// counts one attempt of the event.
package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	ioutbox "github.com/worker-dev/worker/internal/outbox"
)

// Event is what a producer appends. The first four fields are required;
// the zero value of each other field picks the table's default.
type Event struct {
	AggregateType string          // e.g. "order"; with AggregateID, the ordering key
	AggregateID   string          // e.g. "42"
	EventType     string          // e.g. "order.placed"
	Payload       json.RawMessage // any JSON value

	EventID    string            // a UUID; default: a new random one
	Headers    map[string]string // e.g. traceparent; default: none
	OccurredAt time.Time         // default: the transaction's now()
}

// RuleError is an event that breaks a producer rule (an empty key, a key
// too long, a time out of range, headers too large). Append and AppendStd
// return it whether their own check or the table's constraint caught the
// event.
type RuleError struct {
	Constraint string // the table's CHECK constraint, e.g. outbox_event_occurred_at_range
	Problem    string // e.g. "occurred_at is not within years 0001-9999 (UTC)"
	Err        error  // the database's error when the table refused the row; nil when the check before it did
}

// Error names the problem and the rule.
func (e *RuleError) Error() string {
	return fmt.Sprintf("outbox: %s (rule %s)", e.Problem, e.Constraint)
}

// Unwrap returns Err.
func (e *RuleError) Unwrap() error { return e.Err }

// publicError turns the internal producer's *RuleError into this
// package's, and leaves other errors alone.
func publicError(err error) error {
	var re *ioutbox.RuleError
	if errors.As(err, &re) {
		return &RuleError{Constraint: re.Constraint, Problem: re.Problem, Err: re.Err}
	}
	return err
}

// Append inserts e into the outbox inside tx and returns its event_id, the
// id consumers dedupe on. An event that breaks a producer rule is refused
// with a *RuleError; when the table refused it (the RuleError's Err is
// set), tx is aborted, as after any failed statement.
//
// Appending locks e's aggregate until tx ends, so keep the transaction
// short after appending, and append to several aggregates in a consistent
// order.
func Append(ctx context.Context, tx pgx.Tx, e Event) (eventID string, err error) {
	id, err := ioutbox.Append(ctx, tx, ioutbox.NewEvent(e))
	return id, publicError(err)
}

// AppendStd is Append for a database/sql transaction (for example through
// github.com/jackc/pgx/v5/stdlib), with the same rules and the same
// *RuleError.
func AppendStd(ctx context.Context, tx *sql.Tx, e Event) (eventID string, err error) {
	id, err := ioutbox.AppendStd(ctx, tx, ioutbox.NewEvent(e))
	return id, publicError(err)
}

// Message is one outbox event as a sink receives it.
type Message struct {
	EventID       string            // a UUID; consumers dedupe on it
	AggregateType string            // with AggregateID, the ordering key
	AggregateID   string            //
	EventType     string            //
	Payload       json.RawMessage   // the payload as stored (jsonb)
	Headers       map[string]string // e.g. traceparent
	OccurredAt    time.Time         //
	Attempts      int               // attempts before this one
}

// Sink publishes events for the relay. Publish returns nil only once m is
// durably handed over; the relay then marks it published. It must honour
// ctx, whose deadline bounds one publish. The relay calls Publish for one
// aggregate's events one at a time, in order, and for different
// aggregates concurrently.
//
// A sink that also has a Close(ctx context.Context) error method is closed
// after the relay has stopped.
type Sink interface {
	// Name is the sink's name in logs and metrics.
	Name() string
	// Publish hands m to the sink's destination.
	Publish(ctx context.Context, m Message) error
}

// Permanent marks err as a failure that retrying cannot fix (for example a
// payload the destination refuses): the event goes DEAD at once.
func Permanent(err error) error { return ioutbox.Permanent(err) }

// Unavailable marks err as a failure of the sink rather than of the event:
// the destination is down, unreachable or overloaded. The relay stops
// claiming and probes with one event until the sink answers again; no
// event spends an attempt. Network errors, timeouts and a cancelled ctx
// count as unavailable without being wrapped.
func Unavailable(err error) error { return ioutbox.Unavailable(err) }

// RetryAfterError is a transient failure of one event that names the
// earliest retry, as an HTTP Retry-After does: the relay waits at least
// After before the event's next attempt.
type RetryAfterError struct {
	Err   error
	After time.Duration
}

// Error is Err's message.
func (e *RetryAfterError) Error() string { return e.Err.Error() }

// Unwrap returns Err.
func (e *RetryAfterError) Unwrap() error { return e.Err }
