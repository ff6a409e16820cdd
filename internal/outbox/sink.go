package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	"github.com/worker-dev/worker/internal/broker"
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
// handed over. An error is about the event (it counts toward max_attempts)
// unless it is wrapped with Permanent (the event goes DEAD at once) or
// Unavailable (the sink itself is down: the event waits, its attempts
// untouched). A network error, a timeout or a cancelled context counts as
// Unavailable without being wrapped (see IsUnavailable).
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

// UnavailableError marks a failure of the sink, not of the event: the sink
// is down, unreachable, overloaded or did not say whether it took the event.
// The relay then stops claiming and probes the sink with one event until it
// answers again; no event spends an attempt on it (see breaker.go).
type UnavailableError struct{ Err error }

func (e *UnavailableError) Error() string { return e.Err.Error() }
func (e *UnavailableError) Unwrap() error { return e.Err }

// Unavailable wraps err as an UnavailableError.
func Unavailable(err error) error { return &UnavailableError{Err: err} }

// IsUnavailable reports whether err says the sink, rather than the event,
// failed: an UnavailableError, or an error whose outcome is unknown or that
// never reached the sink (refused or reset connections, DNS, TLS
// handshakes, timeouts, EOF). A permanent error is never unavailability.
func IsUnavailable(err error) bool {
	if err == nil || IsPermanent(err) {
		return false
	}
	var u *UnavailableError
	if errors.As(err, &u) {
		return true
	}
	return broker.Unreachable(err)
}
