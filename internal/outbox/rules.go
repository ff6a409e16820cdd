package outbox

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"

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

// rfc3339 formats t in UTC as RFC 3339 with its fraction of a second. An
// instant outside years 0001-9999 has no RFC 3339 form: the sinks refuse
// such an event (a permanent error) rather than send a malformed or clamped
// time. The producer rules and the relay keep those events from sinks, so
// this only guards callers that build events themselves.
func rfc3339(t time.Time) (string, error) {
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
