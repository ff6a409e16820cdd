package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// ruleCase is one producer input. e goes through Append; the same values
// go through a plain SQL INSERT, as a producer in another language writes
// it. headers (JSON) and infinity replace e's fields on the SQL side for
// what a Go NewEvent cannot express; such cases are SQL only.
type ruleCase struct {
	name     string
	e        NewEvent
	headers  string                  // SQL only: the headers JSON
	infinity pgtype.InfinityModifier // SQL only: an infinite occurred_at
	occurred string                  // SQL only: occurred_at as a literal, for what Go's zero time stands for
	want     string                  // the constraint that refuses it; "" = accepted
}

func (c ruleCase) sqlOnly() bool {
	return c.headers != "" || c.infinity != pgtype.Finite || c.occurred != ""
}

func ruleCases() []ruleCase {
	ok := func(mod func(e *NewEvent)) NewEvent {
		e := NewEvent{AggregateType: "order", AggregateID: "1001", EventType: "order.shipped", Payload: json.RawMessage(`{}`)}
		mod(&e)
		return e
	}
	utc := func(y int, m time.Month, d, h, min, s, ns int) time.Time {
		return time.Date(y, m, d, h, min, s, ns, time.UTC)
	}
	return []ruleCase{
		{name: "valid", e: ok(func(*NewEvent) {})},
		{name: "empty aggregate_type", e: ok(func(e *NewEvent) { e.AggregateType = "" }), want: "outbox_event_aggregate_type_not_empty"},
		{name: "empty aggregate_id", e: ok(func(e *NewEvent) { e.AggregateID = "" }), want: "outbox_event_aggregate_id_not_empty"},
		{name: "empty event_type", e: ok(func(e *NewEvent) { e.EventType = "" }), want: "outbox_event_event_type_not_empty"},

		{name: "aggregate_type of 255 bytes", e: ok(func(e *NewEvent) { e.AggregateType = strings.Repeat("t", 255) })},
		{name: "aggregate_type of 256 bytes", e: ok(func(e *NewEvent) { e.AggregateType = strings.Repeat("t", 256) }), want: "outbox_event_aggregate_type_length"},
		// 128 characters, 256 bytes: the limit counts bytes.
		{name: "aggregate_type of 128 two-byte characters", e: ok(func(e *NewEvent) { e.AggregateType = strings.Repeat("é", 128) }), want: "outbox_event_aggregate_type_length"},
		{name: "aggregate_id of 512 bytes", e: ok(func(e *NewEvent) { e.AggregateID = strings.Repeat("i", 512) })},
		{name: "aggregate_id of 513 bytes", e: ok(func(e *NewEvent) { e.AggregateID = strings.Repeat("i", 513) }), want: "outbox_event_aggregate_id_length"},
		{name: "aggregate_id of 10,000 bytes", e: ok(func(e *NewEvent) { e.AggregateID = strings.Repeat("i", 10000) }), want: "outbox_event_aggregate_id_length"},
		{name: "event_type of 255 bytes", e: ok(func(e *NewEvent) { e.EventType = strings.Repeat("e", 255) })},
		{name: "event_type of 256 bytes", e: ok(func(e *NewEvent) { e.EventType = strings.Repeat("e", 256) }), want: "outbox_event_event_type_length"},

		{name: "newline in aggregate_type", e: ok(func(e *NewEvent) { e.AggregateType = "order\n" }), want: "outbox_event_aggregate_type_no_control"},
		{name: "tab in aggregate_type", e: ok(func(e *NewEvent) { e.AggregateType = "or\tder" }), want: "outbox_event_aggregate_type_no_control"},
		{name: "escape in event_type", e: ok(func(e *NewEvent) { e.EventType = "order\x1b[31mshipped" }), want: "outbox_event_event_type_no_control"},
		{name: "DEL in event_type", e: ok(func(e *NewEvent) { e.EventType = "order\x7f" }), want: "outbox_event_event_type_no_control"},
		{name: "C1 control (NEL) in event_type", e: ok(func(e *NewEvent) { e.EventType = "order\u0085shipped" }), want: "outbox_event_event_type_no_control"},
		{name: "non-ASCII printable event_type", e: ok(func(e *NewEvent) { e.EventType = "commande.expédiée\u00a0✓" })},
		{name: "control character in aggregate_id (no rule)", e: ok(func(e *NewEvent) { e.AggregateID = "line\nbreak" })},

		// 0001-01-01T00:00:00Z is Go's zero time, which Append sends as
		// now(): only SQL can write it, and the table refuses it.
		{name: "occurred_at in year 1", e: ok(func(e *NewEvent) { e.OccurredAt = utc(1, 1, 1, 0, 0, 0, 1000) })},
		{name: "occurred_at the zero time", e: ok(func(*NewEvent) {}), occurred: "0001-01-01T00:00:00Z", want: "outbox_event_occurred_at_not_zero"},
		{name: "occurred_at the zero time in another zone", e: ok(func(*NewEvent) {}), occurred: "0001-01-01T01:00:00+01:00", want: "outbox_event_occurred_at_not_zero"},
		{name: "occurred_at at the end of year 9999", e: ok(func(e *NewEvent) { e.OccurredAt = utc(9999, 12, 31, 23, 59, 59, 999999000) })},
		{name: "occurred_at in year 3000", e: ok(func(e *NewEvent) { e.OccurredAt = utc(3000, 1, 1, 0, 0, 0, 0) })},
		{name: "occurred_at in year 10000", e: ok(func(e *NewEvent) { e.OccurredAt = utc(10000, 1, 1, 0, 0, 0, 0) }), want: "outbox_event_occurred_at_range"},
		{name: "occurred_at in 1 BC", e: ok(func(e *NewEvent) { e.OccurredAt = utc(0, 12, 31, 23, 59, 59, 0) }), want: "outbox_event_occurred_at_range"},
		{name: "occurred_at in 4000 BC", e: ok(func(e *NewEvent) { e.OccurredAt = utc(-3999, 1, 1, 0, 0, 0, 0) }), want: "outbox_event_occurred_at_range"},
		// Year 1 locally, 1 BC in UTC: the rule is in UTC.
		{name: "occurred_at in year 1 east of UTC", e: ok(func(e *NewEvent) {
			e.OccurredAt = time.Date(1, 1, 1, 0, 30, 0, 0, time.FixedZone("+01", 3600))
		}), want: "outbox_event_occurred_at_range"},
		{name: "occurred_at infinity", e: ok(func(*NewEvent) {}), infinity: pgtype.Infinity, want: "outbox_event_occurred_at_range"},
		{name: "occurred_at -infinity", e: ok(func(*NewEvent) {}), infinity: pgtype.NegativeInfinity, want: "outbox_event_occurred_at_range"},

		{name: "string headers", e: ok(func(*NewEvent) {}), headers: `{"traceparent": "00-x-y-01", "empty": ""}`},
		{name: "non-string header values", e: ok(func(*NewEvent) {}), headers: `{"x": {"a": "b"}, "n": 5, "z": null}`, want: "outbox_event_headers_strings"},
		{name: "a boolean header value", e: ok(func(*NewEvent) {}), headers: `{"ok": true}`, want: "outbox_event_headers_strings"},

		// The size counts the object as jsonb prints it: {"x-big": "…"} is
		// the value's length plus 13 bytes.
		{name: "headers of 16384 bytes", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat("v", 16371)} })},
		{name: "headers of 16385 bytes", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat("v", 16372)} }), want: "outbox_event_headers_size"},
		{name: "a 100 KB header value", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat("v", 100_000)} }), want: "outbox_event_headers_size"},
		{name: "two headers of 16384 bytes", e: ok(func(e *NewEvent) {
			e.Headers = map[string]string{"a": strings.Repeat("v", 8000), "b": strings.Repeat("w", 8366)}
		})},
		{name: "two headers of 16385 bytes", e: ok(func(e *NewEvent) {
			e.Headers = map[string]string{"a": strings.Repeat("v", 8000), "b": strings.Repeat("w", 8367)}
		}), want: "outbox_event_headers_size"},
		{name: "escaped quotes count twice", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat(`"`, 8186)} }), want: "outbox_event_headers_size"},
		{name: "escaped quotes at the limit", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat(`\`, 8185) + "v"} })},
		{name: "control characters count six times", e: ok(func(e *NewEvent) {
			e.Headers = map[string]string{"x-big": strings.Repeat("\x01", 2728) + "abc"}
		})},
		{name: "control characters past the limit", e: ok(func(e *NewEvent) {
			e.Headers = map[string]string{"x-big": strings.Repeat("\x01", 2728) + "abcd"}
		}), want: "outbox_event_headers_size"},
		{name: "two-byte characters at the limit", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat("é", 8185) + "v"} })},
		{name: "two-byte characters past the limit", e: ok(func(e *NewEvent) { e.Headers = map[string]string{"x-big": strings.Repeat("é", 8186)} }), want: "outbox_event_headers_size"},
	}
}

// TestRulesMatchConstraints keeps the Go rules and the table's constraints
// in step: the rule names are exactly the table's NOT VALID CHECK
// constraints, and every case gets the same answer from Append (which
// checks in Go first) and from a plain SQL INSERT, which the constraints
// alone judge.
func TestRulesMatchConstraints(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()

	rows, err := db.Pool.Query(ctx, `SELECT conname FROM pg_constraint
		WHERE conrelid = 'outbox_event'::regclass AND contype = 'c' AND NOT convalidated ORDER BY conname`)
	if err != nil {
		t.Fatal(err)
	}
	inTable, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var inGo []string
	for _, r := range rules {
		inGo = append(inGo, r.constraint)
	}
	sort.Strings(inGo)
	if strings.Join(inTable, " ") != strings.Join(inGo, " ") {
		t.Fatalf("constraints in the table %v, rules in Go %v", inTable, inGo)
	}

	refused := map[string]bool{}
	for _, c := range ruleCases() {
		refused[c.want] = true
		if got := sqlInsert(t, db, c); got != c.want {
			t.Errorf("%s: SQL INSERT refused by %q, want %q", c.name, got, c.want)
		}
		if c.sqlOnly() {
			continue
		}
		if got := appendRefusal(t, db, c.e); got != c.want {
			t.Errorf("%s: Append refused by %q, want %q", c.name, got, c.want)
		}
	}
	for _, r := range rules {
		if !refused[r.constraint] {
			t.Errorf("no case breaks %s", r.constraint)
		}
	}
}

// sqlInsert inserts c as a producer in any language would, in a
// transaction that is rolled back, and returns the constraint that refused
// it ("" if none). The refusal also comes back as a *RuleError from
// asRuleError, which Append applies to the database's errors.
func sqlInsert(t *testing.T, db *pgtest.DB, c ruleCase) string {
	t.Helper()
	var occurred any
	switch {
	case c.infinity != pgtype.Finite:
		occurred = pgtype.Timestamptz{InfinityModifier: c.infinity, Valid: true}
	case c.occurred != "":
		occurred = c.occurred
	case !c.e.OccurredAt.IsZero():
		occurred = c.e.OccurredAt
	}
	headers := c.headers
	if headers == "" && len(c.e.Headers) == 0 {
		headers = "{}"
	} else if headers == "" {
		b, err := json.Marshal(c.e.Headers) // as Append sends them
		if err != nil {
			t.Fatal(err)
		}
		headers = string(b)
	}
	var constraint string
	err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(context.Background(), `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers, occurred_at)
VALUES ($1, $2, $3, '{}', $4::jsonb, coalesce($5::timestamptz, now()))`,
			c.e.AggregateType, c.e.AggregateID, c.e.EventType, headers, occurred)
		if err != nil {
			return err
		}
		return errors.New("rollback")
	})
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "23514":
		constraint = pgErr.ConstraintName
		var re *RuleError
		if !errors.As(asRuleError(err), &re) || re.Constraint != constraint || !errors.Is(re, err) {
			t.Errorf("%s: asRuleError(%v) = %v", c.name, err, asRuleError(err))
		}
	case err != nil && err.Error() != "rollback":
		t.Fatalf("%s: insert: %v", c.name, err)
	}
	return constraint
}

// appendRefusal appends e in a transaction that is rolled back and returns
// the rule Append named ("" if it accepted e).
func appendRefusal(t *testing.T, db *pgtest.DB, e NewEvent) string {
	t.Helper()
	var err error
	_ = pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error {
		_, err = Append(context.Background(), tx, e)
		return errors.New("rollback")
	})
	if err == nil {
		return ""
	}
	var re *RuleError
	if !errors.As(err, &re) {
		t.Fatalf("Append: %v, want a *RuleError", err)
	}
	if !strings.Contains(err.Error(), re.Constraint) {
		t.Errorf("error %q does not name %s", err, re.Constraint)
	}
	return re.Constraint
}

// TestLatencyIgnoresNegativeAndOverflow: an occurred_at in the future
// (negative latency) or centuries ago (a saturated time.Duration) is not
// observed; an ordinary latency is.
func TestLatencyIgnoresNegativeAndOverflow(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, outboxconfig.SinkLog)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	m.observeLatency(now.Sub(now.AddDate(975, 0, 0)))                   // year 3000: negative
	m.observeLatency(now.Sub(time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC))) // year 1: saturated
	m.observeLatency(now.Sub(time.Date(-3999, 1, 1, 0, 0, 0, 0, time.UTC)))
	if n, _ := testkit.Metric(t, reg, "outbox_publish_latency_seconds", nil); n != 0 {
		t.Fatalf("%v observations of impossible latencies", n)
	}
	m.observeLatency(1500 * time.Millisecond)
	if n, _ := testkit.Metric(t, reg, "outbox_publish_latency_seconds", nil); n != 1 {
		t.Errorf("%v observations after an ordinary latency, want 1", n)
	}
}

// TestEventTypeLabelHasNoControlCharacters: rows from before the producer
// rules may carry control characters in event_type; the label does not.
func TestEventTypeLabelHasNoControlCharacters(t *testing.T) {
	t.Parallel()
	m, err := newMetrics(nil, outboxconfig.SinkLog)
	if err != nil {
		t.Fatal(err)
	}
	for in, want := range map[string]string{
		"order.shipped":         "order.shipped",
		"order\nshipped":        "order_shipped",
		"a\x1b[31mb\x7f\u0085ü": "a_[31mb__ü",
		"commande.expédiée":     "commande.expédiée",
	} {
		if got := m.eventType(in); got != want {
			t.Errorf("label for %q = %q, want %q", in, got, want)
		}
	}
}

// TestFailureSeriesExistAtZero: outbox_publish_failures_total has both
// kinds at zero from the start (for event_type "other"), and an event type
// gets its own zero series when first seen, before any failure.
func TestFailureSeriesExistAtZero(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, outboxconfig.SinkLog)
	if err != nil {
		t.Fatal(err)
	}
	for _, kind := range []string{kindTransient, kindPermanent, kindUnavailable} {
		if v, ok := testkit.Metric(t, reg, "outbox_publish_failures_total", map[string]string{"event_type": otherEventType, "kind": kind}); !ok || v != 0 {
			t.Errorf("failures{other,%s} = %v (present %v) at start, want 0", kind, v, ok)
		}
	}
	m.published.WithLabelValues(m.eventType("order.shipped")).Inc()
	for _, kind := range []string{kindTransient, kindPermanent, kindUnavailable} {
		if v, ok := testkit.Metric(t, reg, "outbox_publish_failures_total", map[string]string{"event_type": "order.shipped", "kind": kind}); !ok || v != 0 {
			t.Errorf("failures{order.shipped,%s} = %v (present %v) after a publish, want 0", kind, v, ok)
		}
	}
	if n := testutil.CollectAndCount(reg, "outbox_publish_failures_total"); n != 6 {
		t.Errorf("%d failure series, want 6", n)
	}
}

// TestSinksWriteRFC3339: the log sink's occurred_at is RFC 3339 for years
// 0001-9999; an event outside them is a permanent error and nothing is
// written (the webhook's ce-time: sink/webhook's test of the same name).
func TestSinksWriteRFC3339(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	logSink := NewLogSink(&out)
	for _, c := range []struct {
		at   time.Time
		want string // "" = refused
	}{
		{time.Date(1, 1, 1, 12, 0, 0, 0, time.UTC), "0001-01-01T12:00:00Z"},
		{time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC), "9999-12-31T23:59:59.999999Z"},
		{time.Date(2024, 5, 6, 9, 8, 9, 0, time.FixedZone("+02", 7200)), "2024-05-06T07:08:09Z"},
		{time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), ""},
		{time.Date(-3999, 1, 1, 0, 0, 0, 0, time.UTC), ""},
		{time.Date(0, 12, 31, 23, 0, 0, 0, time.UTC), ""},
	} {
		e := Event{EventID: "0b6a3c5e-2f4d-4e61-9d9a-7c1c2f0e8b11", AggregateType: "order", AggregateID: "order-1001",
			EventType: "order.shipped", Payload: json.RawMessage(`{"order_id": 1001}`), OccurredAt: c.at}
		out.Reset()
		lerr := logSink.Publish(context.Background(), e)
		if c.want == "" {
			if !IsPermanent(lerr) || !strings.Contains(lerr.Error(), "outbox_event_occurred_at_range") {
				t.Errorf("%s: log sink %v; want a permanent error naming the rule", c.at, lerr)
			}
			if out.Len() != 0 {
				t.Errorf("%s: an event without an RFC 3339 time was sent", c.at)
			}
			continue
		}
		if lerr != nil {
			t.Fatalf("%s: log sink %v", c.at, lerr)
		}
		var line struct {
			OccurredAt string `json:"occurred_at"`
		}
		if err := json.Unmarshal([]byte(out.String()), &line); err != nil || line.OccurredAt != c.want {
			t.Errorf("log sink occurred_at %q (%v), want %q", line.OccurredAt, err, c.want)
		}
	}
}

// TestRelayDeadLettersZeroOccurredAt: a row written before the rules with
// occurred_at 0001-01-01T00:00:00Z cannot be told from no time at all, so
// the relay dead-letters it naming the rule instead of publishing it
// without ce-time; a year-1 instant that is not the zero time is read.
func TestRelayDeadLettersZeroOccurredAt(t *testing.T) {
	t.Parallel()
	zero := pgtype.Timestamptz{Time: time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC), Valid: true}
	if _, err := occurredAt(zero); !IsPermanent(err) || !strings.Contains(err.Error(), "outbox_event_occurred_at_not_zero") {
		t.Errorf("occurredAt(zero) = %v, want a permanent error naming the rule", err)
	}
	noon := time.Date(1, 1, 1, 12, 0, 0, 0, time.UTC)
	if got, err := occurredAt(pgtype.Timestamptz{Time: noon, Valid: true}); err != nil || !got.Equal(noon) {
		t.Errorf("occurredAt(year 1 noon) = %v, %v", got, err)
	}
}
