package outbox_test

// Rows the relay cannot publish: written before the producer rules existed
// (migration 00040), or by hand. The migration must not trip over them,
// and they must not stop the relay, its metrics or `outbox stats`.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
	"github.com/worker-dev/worker/migrations"
)

// versionBeforeRules is the last migration without the producer rules.
const versionBeforeRules = 30

// legacyDB returns a database whose rows in inserts were written under
// migration 00030, before the producer rules, and which was then migrated
// to the end by migrate.Up, as an upgraded deployment is.
func legacyDB(t *testing.T, inserts ...string) *pgtest.DB {
	t.Helper()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer sqlDB.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS, goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, versionBeforeRules); err != nil {
		t.Fatalf("migrate to %d: %v", versionBeforeRules, err)
	}
	for _, q := range inserts {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("legacy insert %q: %v", q, err)
		}
	}
	if err := migrate.Up(ctx, db.Pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatalf("migrate over legacy rows: %v", err)
	}
	return db
}

// legacyRow inserts one event with the given column values (SQL
// expressions) into aggregate "order"/aggID.
func legacyRow(aggID, eventType, occurredAt, headers string) string {
	return fmt.Sprintf(`INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, occurred_at, headers)
		VALUES ('order', %s, %s, '{}', %s, %s)`, aggID, eventType, occurredAt, headers)
}

// TestContractRulesMigrateOverBadRows: rows that break every rule do not
// stop migration 00040, stay as they were, and new inserts like them are
// refused with the rule's name.
func TestContractRulesMigrateOverBadRows(t *testing.T) {
	t.Parallel()
	db := legacyDB(t,
		legacyRow("'inf'", "'x'", "'infinity'", "'{}'"),
		legacyRow("'-inf'", "'x'", "'-infinity'", "'{}'"),
		legacyRow("'bc'", "'x'", "'4000-01-01 BC'", "'{}'"),
		legacyRow("''", "''", "now()", `'{"x": {"a": "b"}, "n": 5, "z": null}'`),
		legacyRow("repeat('i', 2000)", "E'order\\nshipped'", "now()", "'{}'"),
	)
	ctx := context.Background()
	var rows, unvalidated int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_event_state),
		(SELECT count(*) FROM pg_constraint WHERE conrelid = 'outbox_event'::regclass AND contype = 'c' AND NOT convalidated)`).
		Scan(&rows, &unvalidated); err != nil {
		t.Fatal(err)
	}
	if rows != 5 || unvalidated != 12 {
		t.Errorf("after the migration: %d rows (want the 5 old ones), %d NOT VALID rules (want 12)", rows, unvalidated)
	}
	for q, rule := range map[string]string{
		legacyRow("'inf'", "'x'", "'infinity'", "'{}'"):         "outbox_event_occurred_at_range",
		legacyRow("''", "'x'", "now()", "'{}'"):                 "outbox_event_aggregate_id_not_empty",
		legacyRow("'h'", "'x'", "now()", `'{"n": 5}'`):          "outbox_event_headers_strings",
		legacyRow("repeat('i', 10000)", "'x'", "now()", "'{}'"): "outbox_event_aggregate_id_length",
		legacyRow("'c'", "E'order\\nshipped'", "now()", "'{}'"): "outbox_event_event_type_no_control",
	} {
		_, err := db.Pool.Exec(ctx, q)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.ConstraintName != rule {
			t.Errorf("%s: %v, want a violation of %s", q, err, rule)
		}
	}
	// An operator cannot turn a fresh row into a bad one either: an
	// envelope is never updated.
	id := contractAppend(t, db.Pool, "ok", "x")
	_, err := db.Pool.Exec(ctx, `UPDATE outbox_event SET occurred_at = 'infinity' WHERE event_id = $1`, id)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23001" || !strings.Contains(pgErr.Message, "immutable") {
		t.Errorf("update to infinity: %v, want the envelope's refusal", err)
	}
}

// TestContractRelayDeadLettersUnreadableRows: rows written before the
// rules with an occurred_at no sink can express (infinite, 4000 BC, year
// 20000) go DEAD at once, with last_error naming the rule, a
// JOB_DEAD_LETTER line and job_dlq_total, without reaching the sink; 100
// events of other aggregates, and the later event of a bad row's
// aggregate, are published meanwhile. Other old rows the relay can publish
// (a control character in event_type, a non-string header value) are
// published, under a clean metric label and with the value's JSON text. The metrics refresh and `outbox stats` work while bad rows
// are in the table, and latencies from a year-3000 or year-1 occurred_at
// are left out of the histogram.
func TestContractRelayDeadLettersUnreadableRows(t *testing.T) {
	t.Parallel()
	bad := map[string]string{ // aggregate id -> occurred_at
		"bad-inf":   "'infinity'",
		"bad-ninf":  "'-infinity'",
		"bad-bc":    "'4000-01-01 BC'",
		"bad-20000": "'20000-01-01'",
	}
	var inserts []string
	for agg, at := range bad {
		inserts = append(inserts, legacyRow("'"+agg+"'", "'x'", at, "'{}'"))
	}
	inserts = append(inserts, legacyRow("'ctl'", "E'order\\nshipped'", "now()", `'{"n": 5}'`))
	db := legacyDB(t, inserts...)
	ctx := context.Background()

	// `outbox stats` reads a table with infinite occurred_at values.
	st, err := outbox.ReadStats(ctx, db.Pool)
	if err != nil || st.ByStatus[outbox.StatusPending] != 5 || st.OldestPending.Year() != -3999 {
		t.Fatalf("ReadStats: %+v, %v", st, err)
	}
	var printed strings.Builder
	if err := outbox.PrintStats(&printed, st); err != nil || !strings.Contains(printed.String(), "over 292 years old") {
		t.Errorf("PrintStats: %q, %v", printed.String(), err)
	}

	// Hold the infinity row so that it stays PENDING for a while: the
	// gauges must count it, not fail on it.
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM outbox_delivery WHERE aggregate_id = 'bad-inf' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}

	var good []string
	for i := range 100 {
		good = append(good, contractAppend(t, db.Pool, fmt.Sprintf("good-%03d", i), "order.updated"))
	}
	var afterHeld string // waits for the held row, its aggregate's head
	for agg := range bad {
		id := contractAppend(t, db.Pool, agg, "order.after")
		if agg == "bad-inf" {
			afterHeld = id
			continue
		}
		good = append(good, id)
	}
	for _, at := range []time.Time{time.Date(3000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(1, 1, 1, 12, 0, 0, 0, time.UTC)} {
		e := contractNewEvent("far-"+at.Format("2006"), "order.far")
		e.OccurredAt = at
		id, err := outbox.Emit(ctx, db.Pool, e)
		if err != nil {
			t.Fatal(err)
		}
		good = append(good, id)
	}

	sink := newContractRecordingSink(nil)
	reg := prometheus.NewRegistry()
	log, logs := contractJSONLogger(t)
	cfg := contractConfig()
	cfg.MetricsInterval = 100 * time.Millisecond
	contractStartRelay(t, db.Pool, sink, cfg, "malformed", log, reg)

	metric := func(name string, labels map[string]string) float64 {
		v, _ := testkit.Metric(t, reg, name, labels)
		return v
	}
	testkit.Eventually(t, 30*time.Second, "every good event published", func() bool {
		for _, id := range good {
			if sink.deliveredCount(id) == 0 {
				return false
			}
		}
		return true
	})
	testkit.Eventually(t, 10*time.Second, "the gauges to count the held infinity row and its successor", func() bool {
		return metric("outbox_pending_size", map[string]string{"status": "PENDING"}) == 2 &&
			metric("outbox_pending_size", map[string]string{"status": "DEAD"}) == 3
	})
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the infinity row dead-lettered and its successor published", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusDead) == 4 && sink.deliveredCount(afterHeld) == 1
	})
	// Metrics and logs follow a batch's commit, which comes with the next
	// claim.
	testkit.Eventually(t, 10*time.Second, "every outcome recorded in the metrics", func() bool {
		published := 0.0
		for _, typ := range []string{"order.updated", "order.after", "order.far", "order_shipped"} {
			published += metric("outbox_published_total", map[string]string{"event_type": typ})
		}
		deadLines := 0
		for _, l := range logs.Lines(t, "") {
			if l["error.code"] == obs.CodeJobDeadLetter {
				deadLines++
			}
		}
		return published == 107 && deadLines == 4 &&
			metric("job_dlq_total", map[string]string{"job_name": outbox.RelayJobName}) == 4
	})

	for agg, at := range bad {
		var status, lastErr, eventID string
		var attempts int
		if err := db.Pool.QueryRow(ctx, `SELECT status, attempts, coalesce(last_error, ''), event_id::text FROM outbox_event_state
			WHERE aggregate_id = $1 AND event_type = 'x'`, agg).Scan(&status, &attempts, &lastErr, &eventID); err != nil {
			t.Fatal(err)
		}
		if status != outbox.StatusDead || attempts != 1 || !strings.Contains(lastErr, "outbox_event_occurred_at_range") {
			t.Errorf("%s (occurred_at %s): %s after %d attempts, last_error %q", agg, at, status, attempts, lastErr)
		}
		if sink.callCount(eventID) != 0 {
			t.Errorf("%s reached the sink", agg)
		}
		found := false
		for _, l := range logs.Lines(t, "") {
			if l["event_id"] == eventID && l["error.code"] == obs.CodeJobDeadLetter {
				found = true
			}
		}
		if !found {
			t.Errorf("%s: no JOB_DEAD_LETTER line with its event_id", agg)
		}
	}
	if v := metric("outbox_publish_failures_total", map[string]string{"event_type": "x", "kind": "permanent"}); v != 4 {
		t.Errorf("permanent failures of event type x = %v, want 4", v)
	}
	var ctl outbox.Event
	for _, d := range sink.deliveries() {
		if d.Event.AggregateID == "ctl" {
			ctl = d.Event
		}
	}
	if ctl.Headers["n"] != "5" {
		t.Errorf("old row's non-string header value: headers %v, want its JSON text", ctl.Headers)
	}
	if v := metric("outbox_published_total", map[string]string{"event_type": "order_shipped"}); v != 1 {
		t.Errorf("outbox_published_total{event_type=order_shipped} = %v, want the old control-character row", v)
	}
	// 100 + 4 ordinary latencies and the old "ctl" row; not the two far
	// ones, and no negative sum.
	if n := metric("outbox_publish_latency_seconds", nil); n != 105 {
		t.Errorf("%v latency observations, want 105", n)
	}
	if sum := testkit.HistogramSum(t, reg, "outbox_publish_latency_seconds"); sum < 0 || sum > 105*60 {
		t.Errorf("latency sum %v s", sum)
	}
}
