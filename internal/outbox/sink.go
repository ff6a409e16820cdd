package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"time"
)

// Event is one outbox row as a sink sees it.
type Event struct {
	Seq           int64             // outbox_event.id: insertion order
	EventID       string            // uuid; consumers dedupe on it
	AggregateType string            //
	AggregateID   string            //
	EventType     string            //
	Payload       json.RawMessage   // jsonb, as stored
	Headers       map[string]string // e.g. traceparent
	OccurredAt    time.Time         //
	Attempts      int               // attempts before this one
}

// Sink publishes events. Publish returns nil only when the event is durably
// handed over. An error is transient unless wrapped with Permanent.
type Sink interface {
	Name() string
	Publish(ctx context.Context, e Event) error
}

// PermanentError marks a failure that retrying cannot fix: the event goes
// DEAD at once.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err as a PermanentError.
func Permanent(err error) error { return &PermanentError{Err: err} }

// IsPermanent reports whether err is a PermanentError.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// RetryAfterError is a transient failure that names the earliest retry, as
// an HTTP Retry-After does. The relay waits at least that long.
type RetryAfterError struct {
	Err   error
	After time.Duration
}

func (e *RetryAfterError) Error() string { return e.Err.Error() }
func (e *RetryAfterError) Unwrap() error { return e.Err }
