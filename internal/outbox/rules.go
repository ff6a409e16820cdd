package outbox

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// Producer rules. The table's CHECK constraints (migrations/
// 00040_outbox_rules.sql) are the source of truth: they hold for producers
// in any language. Append checks the same rules in Go first, for an error
// that says more; TestRulesMatchConstraints runs the same cases through
// both and checks that the names below are exactly the table's.
const (
	// Limits in bytes (UTF-8), as octet_length counts them.
	MaxAggregateTypeBytes = 255
	MaxAggregateIDBytes   = 512
	MaxEventTypeBytes     = 255
	// MaxHeadersBytes bounds the headers object as jsonb prints it
	// ({"k": "v", ...}): what every sink can carry beside its own headers
	// (migrations/00082_outbox_headers_size_occurred_at.sql says why).
	MaxHeadersBytes = 16384
)

// rule is one producer rule: its constraint and what breaking it means.
type rule struct {
	constraint string
	problem    string
	// broken reports whether e breaks the rule; nil when the Go type
	// cannot break it (header values are strings by type).
	broken func(e NewEvent) bool
}

var rules = []rule{
	{"outbox_event_aggregate_type_not_empty", "aggregate_type is empty",
		func(e NewEvent) bool { return e.AggregateType == "" }},
	{"outbox_event_aggregate_id_not_empty", "aggregate_id is empty",
		func(e NewEvent) bool { return e.AggregateID == "" }},
	{"outbox_event_event_type_not_empty", "event_type is empty",
		func(e NewEvent) bool { return e.EventType == "" }},
	{"outbox_event_aggregate_type_length", fmt.Sprintf("aggregate_type is longer than %d bytes", MaxAggregateTypeBytes),
		func(e NewEvent) bool { return len(e.AggregateType) > MaxAggregateTypeBytes }},
	{"outbox_event_aggregate_id_length", fmt.Sprintf("aggregate_id is longer than %d bytes", MaxAggregateIDBytes),
		func(e NewEvent) bool { return len(e.AggregateID) > MaxAggregateIDBytes }},
	{"outbox_event_event_type_length", fmt.Sprintf("event_type is longer than %d bytes", MaxEventTypeBytes),
		func(e NewEvent) bool { return len(e.EventType) > MaxEventTypeBytes }},
	{"outbox_event_aggregate_type_no_control", "aggregate_type contains a control character",
		func(e NewEvent) bool { return hasControl(e.AggregateType) }},
	{"outbox_event_event_type_no_control", "event_type contains a control character",
		func(e NewEvent) bool { return hasControl(e.EventType) }},
	{"outbox_event_occurred_at_range", "occurred_at is not within years 0001-9999 (UTC)",
		func(e NewEvent) bool { return !e.OccurredAt.IsZero() && !inRFC3339Range(e.OccurredAt) }},
	{"outbox_event_headers_strings", "a header value is not a string", nil},
	{"outbox_event_headers_size", fmt.Sprintf("headers are longer than %d bytes as JSON", MaxHeadersBytes),
		func(e NewEvent) bool { return headersTextLen(e.Headers) > MaxHeadersBytes }},
	// Append sends a zero OccurredAt as now(), so only SQL can break it.
	{"outbox_event_occurred_at_not_zero", "occurred_at is 0001-01-01T00:00:00Z, the zero time of Go and .NET: set the time or leave the column out", nil},
}

// RuleError is an event that breaks a producer rule. Append returns it
// whether its own check or the table's constraint caught the event; Err is
// the *pgconn.PgError in the second case.
type RuleError struct {
	Constraint string // e.g. outbox_event_occurred_at_range
	Problem    string // e.g. "occurred_at is not within years 0001-9999 (UTC)"
	Err        error
}

func (e *RuleError) Error() string {
	return fmt.Sprintf("outbox: %s (rule %s)", e.Problem, e.Constraint)
}

func (e *RuleError) Unwrap() error { return e.Err }

// checkRules returns the first rule e breaks, as a *RuleError.
func checkRules(e NewEvent) error {
	for _, r := range rules {
		if r.broken != nil && r.broken(e) {
			return &RuleError{Constraint: r.constraint, Problem: r.problem}
		}
	}
	return nil
}

// asRuleError turns the database's refusal of a row into a *RuleError
// when it is one of the producer rules, and returns err unchanged
// otherwise.
func asRuleError(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23514" { // check_violation
		return err
	}
	for _, r := range rules {
		if r.constraint == pgErr.ConstraintName {
			return &RuleError{Constraint: r.constraint, Problem: r.problem, Err: err}
		}
	}
	return err
}

// hasControl reports whether s contains a control character (Unicode Cc:
// U+0000-U+001F, U+007F-U+009F), as the constraints' regex range does.
func hasControl(s string) bool { return strings.ContainsFunc(s, unicode.IsControl) }

// inRFC3339Range reports whether t, in UTC, falls in years 0001-9999: the
// only ones RFC 3339 can write (four digits, no sign).
func inRFC3339Range(t time.Time) bool {
	y := t.UTC().Year()
	return y >= 1 && y <= 9999
}

// RFC3339 formats t in UTC as RFC 3339 with its fraction of a second. An
// instant outside years 0001-9999 has no RFC 3339 form: the sinks refuse
// such an event (a permanent error) rather than send a malformed or clamped
// time. The producer rules and the relay keep those events from sinks, so
// this only guards callers that build events themselves.
func RFC3339(t time.Time) (string, error) {
	if !inRFC3339Range(t) {
		return "", occurredAtRangeError(t.UTC().String())
	}
	return t.UTC().Format(time.RFC3339Nano), nil
}

// occurredAtRangeError is the permanent error of an event whose occurred_at
// (shown as value) no sink can express.
func occurredAtRangeError(value string) error {
	return Permanent(fmt.Errorf("occurred_at %s is outside years 0001-9999, which RFC 3339 cannot express (rule outbox_event_occurred_at_range)", value))
}

// headersTextLen is the length in bytes of h as PostgreSQL prints the
// jsonb Append stores ({"k": "v", "k2": "v2"}), which the constraint
// outbox_event_headers_size measures.
func headersTextLen(h map[string]string) int {
	if len(h) == 0 {
		return len("{}")
	}
	n := len("{}") + (len(h)-1)*len(", ")
	for k, v := range h {
		n += jsonbStringLen(k) + len(": ") + jsonbStringLen(v)
	}
	return n
}

// jsonbStringLen is the length of s as a quoted jsonb string: PostgreSQL
// escapes '"', '\\' and control characters, and stores the UTF-8 of the
// rest; encoding/json (which Append encodes with) turns each byte of
// invalid UTF-8 into U+FFFD, three bytes.
func jsonbStringLen(s string) int {
	n := len(`""`)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		i += size
		switch {
		case r == utf8.RuneError && size == 1:
			n += utf8.RuneLen(utf8.RuneError)
		case r == '"' || r == '\\' || r == '\b' || r == '\f' || r == '\n' || r == '\r' || r == '\t':
			n += 2
		case r < ' ':
			n += len(`\u0000`)
		default:
			n += size
		}
	}
	return n
}
