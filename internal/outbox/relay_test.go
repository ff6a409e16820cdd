package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestRelayEventFields: the sink gets the row as stored: id as Seq, the
// event_id, payload bytes, headers, occurred_at and the attempts made
// before.
func TestRelayEventFields(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	occurred := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	var seq int64
	err := db.Pool.QueryRow(ctx, `
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at)
VALUES ('6f1c0b54-8f0e-4d4e-9a53-3a3f6a1f5f10', 'order', '42', 'order.paid', '{"total": 12.5}',
        '{"traceparent": "00-abc-def-01", "retries": "2"}', $1)
RETURNING id`, occurred).Scan(&seq)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	startRelay(t, db.Pool, rec, testConfig(), nil)
	testkit.Eventually(t, 10*time.Second, "the event published", func() bool { return len(rec.delivered()) == 1 })
	e := rec.delivered()[0]
	if e.Seq != seq || e.EventID != "6f1c0b54-8f0e-4d4e-9a53-3a3f6a1f5f10" || e.AggregateType != "order" ||
		e.AggregateID != "42" || e.EventType != "order.paid" || !e.OccurredAt.Equal(occurred) || e.Attempts != 0 {
		t.Errorf("event = %+v", e)
	}
	if string(e.Payload) != `{"total": 12.5}` {
		t.Errorf("payload = %s", e.Payload)
	}
	if e.Headers["traceparent"] != "00-abc-def-01" || e.Headers["retries"] != "2" || len(e.Headers) != 2 {
		t.Errorf("headers = %v", e.Headers)
	}
}

// TestRelayRunStopsAtEventNotDue: an aggregate's claimed run stops at its
// first event that waits for a retry. Here an operator requeued an earlier
// DEAD event (block_on_dead=false let the later ones go on), so the
// aggregate reads: due, FAILED until later, due. Only the first may go.
func TestRelayRunStopsAtEventNotDue(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	first := appendEvent(t, db.Pool, "x", "e1")
	waiting := appendEvent(t, db.Pool, "x", "e2")
	last := appendEvent(t, db.Pool, "x", "e3")
	setDelivery(t, db.Pool, waiting, "status = 'FAILED', attempts = 1, next_attempt_at = now() + interval '1 hour'")
	rec := &recorder{}
	startRelay(t, db.Pool, rec, testConfig(), nil)
	testkit.Eventually(t, 10*time.Second, "the due head published", func() bool { return statusOf(t, db.Pool, first) == StatusPublished })
	// A barrier: an event inserted afterwards is published, so the relay
	// has claimed again since.
	barrier := appendEvent(t, db.Pool, "y", "barrier")
	testkit.Eventually(t, 10*time.Second, "the barrier published", func() bool { return rec.has(barrier) })
	if s := statusOf(t, db.Pool, last); s != StatusPending || rec.has(last) {
		t.Errorf("event behind a retry that is not due: status %s, delivered %v", s, rec.has(last))
	}
	if rec.has(waiting) {
		t.Error("the FAILED event was retried before its time")
	}
}

// TestRelayInFlightVisibility: an IN_FLIGHT row (claimed by status, as
// another claimer might) holds its aggregate until its visibility deadline
// (next_attempt_at) passes; then it is reclaimed, and its successor follows.
func TestRelayInFlightVisibility(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	held := appendEvent(t, db.Pool, "x", "held")
	next := appendEvent(t, db.Pool, "x", "next")
	setDelivery(t, db.Pool, held, "status = 'IN_FLIGHT', claimed_by = 'elsewhere', next_attempt_at = now() + interval '1500 milliseconds'")
	rec := &recorder{}
	startRelay(t, db.Pool, rec, testConfig(), nil)
	other := appendEvent(t, db.Pool, "y", "other")
	testkit.Eventually(t, 10*time.Second, "another aggregate published", func() bool { return rec.has(other) })
	if rec.has(held) || rec.has(next) {
		t.Fatal("an aggregate held IN_FLIGHT was published before its visibility deadline")
	}
	testkit.Eventually(t, 10*time.Second, "the expired claim reclaimed and its successor published", func() bool {
		return statusOf(t, db.Pool, next) == StatusPublished
	})
	var order []string
	for _, e := range rec.delivered() {
		if e.AggregateID == "x" {
			order = append(order, e.EventID)
		}
	}
	if fmt.Sprint(order) != fmt.Sprint([]string{held, next}) {
		t.Errorf("aggregate x delivered %v, want [%s %s]", order, held, next)
	}
}

// TestRelayLooksPastRetries: with a small batch, far more than the widest
// window is taken by aggregates whose heads wait for a retry. The relay must
// look behind them and publish the aggregate behind them,
// and must not publish the blocked aggregates' later events.
func TestRelayLooksPastRetries(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	// 40 aggregates x 3 events; every head FAILED with a retry in an hour.
	exec(t, db.Pool, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', 'blocked-' || g % 40, 'blocked', '{}' FROM generate_series(0, 119) g ORDER BY g`)
	exec(t, db.Pool, `UPDATE outbox_delivery SET status = 'FAILED', attempts = 1, next_attempt_at = now() + interval '1 hour'
		WHERE id IN (SELECT min(id) FROM outbox_delivery GROUP BY aggregate_id)`)
	free := appendEvent(t, db.Pool, "free", "free")
	cfg := testConfig()
	cfg.BatchSize = 2 // widest window: 16 rows, all blocked
	rec := &recorder{}
	startRelay(t, db.Pool, rec, cfg, nil)
	// The sink sees the event before its batch commits: wait for the row.
	testkit.Eventually(t, 10*time.Second, "the event behind the blocked window published", func() bool {
		return rec.has(free) && statusOf(t, db.Pool, free) == StatusPublished
	})
	for _, e := range rec.delivered() {
		if e.EventType == "blocked" {
			t.Fatalf("event %d of a blocked aggregate was published", e.Seq)
		}
	}
	var pending int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_state WHERE status = 'PENDING'`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 80 {
		t.Errorf("%d PENDING events, want the 80 blocked ones", pending)
	}
}

// TestRelayListenerReconnects: with polling out of the picture, an event is
// published promptly both before and after the LISTEN connection is killed,
// so the listener reconnected.
func TestRelayListenerReconnects(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := testConfig()
	cfg.PollInterval = time.Hour
	rec := &recorder{}
	startRelay(t, db.Pool, rec, cfg, nil)
	listeners := func() []int64 {
		rows, err := db.Pool.Query(context.Background(),
			`SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-listener' AND datname = current_database()`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var pids []int64
		for rows.Next() {
			var pid int64
			if err := rows.Scan(&pid); err != nil {
				t.Fatal(err)
			}
			pids = append(pids, pid)
		}
		return pids
	}
	testkit.Eventually(t, 10*time.Second, "the listener connected", func() bool { return len(listeners()) == 1 })
	before := appendEvent(t, db.Pool, "a", "before")
	testkit.Eventually(t, 5*time.Second, "an event published by notification", func() bool { return rec.has(before) })

	old := listeners()[0]
	exec(t, db.Pool, "SELECT pg_terminate_backend($1)", old)
	testkit.Eventually(t, 10*time.Second, "a new listener", func() bool {
		p := listeners()
		return len(p) == 1 && p[0] != old
	})
	after := appendEvent(t, db.Pool, "a", "after")
	testkit.Eventually(t, 5*time.Second, "an event published by notification after the reconnect", func() bool { return rec.has(after) })
}

// TestRelayMetrics: known series exist at zero from the start; then the
// gauges follow the table and the counters and histograms follow the
// publishes.
func TestRelayMetrics(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	reg := prometheus.NewRegistry()
	release := make(chan struct{})
	rec := &recorder{fail: func(ctx context.Context, e Event) error {
		if e.EventType != "slow" {
			return nil
		}
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}}
	r, err := NewRelay(db.Pool, rec, testConfig(), "metrics", nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{StatusPending, StatusInFlight, StatusFailed, StatusDead} {
		if v := testutil.ToFloat64(r.m.pending.WithLabelValues(s)); v != 0 {
			t.Errorf("outbox_pending_size{status=%q} = %v at start", s, v)
		}
	}
	if n := testutil.CollectAndCount(reg, "job_retry_total", "job_dlq_total", "outbox_pending_size"); n != 6 {
		t.Errorf("%d known series before the first event, want 6", n)
	}

	// Three quick events, then an hour-old one whose publish hangs (a
	// batch publishes in order, so it comes last).
	for range 3 {
		appendEvent(t, db.Pool, "fast", "fast")
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer func() {
		close(release)
		if err := r.Shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	}()
	testkit.Eventually(t, 10*time.Second, "the fast events counted", func() bool {
		return testutil.ToFloat64(r.m.published.WithLabelValues("fast")) == 3
	})
	exec(t, db.Pool, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, occurred_at)
		VALUES ('order', 'slow', 'slow', '{}', now() - interval '1 hour')`)
	// The hanging publish is detached after detach_after, which writes the
	// event IN_FLIGHT until it ends: a steady state the refresh must show.
	testkit.Eventually(t, 10*time.Second, "the gauges refreshed", func() bool {
		return testutil.ToFloat64(r.m.pending.WithLabelValues(StatusInFlight)) == 1 &&
			testutil.ToFloat64(r.m.pending.WithLabelValues(StatusPending)) == 0 &&
			testutil.ToFloat64(r.m.lag.WithLabelValues("slow")) >= 3600
	})
	if n := testutil.CollectAndCount(reg, "outbox_publish_latency_seconds"); n != 1 {
		t.Errorf("latency histogram series: %d", n)
	}
	if got := histogramCount(t, reg, "outbox_publish_latency_seconds"); got < 3 {
		t.Errorf("latency observations: %d, want at least 3", got)
	}
	if got := histogramCount(t, reg, "outbox_batch_size"); got < 1 {
		t.Errorf("batch size observations: %d", got)
	}
	testkit.Eventually(t, 10*time.Second, "outbox_claimed_events to show the hanging publish", func() bool {
		return testutil.ToFloat64(r.m.claimed) == 1
	})
}

func histogramCount(t *testing.T, g prometheus.Gatherer, name string) uint64 {
	t.Helper()
	v, ok := testkit.Metric(t, g, name, nil)
	if !ok {
		t.Fatalf("no metric %s", name)
	}
	return uint64(v)
}

// TestRelayEventTypeLabelsAreCapped: past maxEventTypes distinct event
// types, the label value is "other".
func TestRelayEventTypeLabelsAreCapped(t *testing.T) {
	m, err := newMetrics(nil, outboxconfig.SinkLog)
	if err != nil {
		t.Fatal(err)
	}
	for i := range maxEventTypes {
		if got := m.eventType(fmt.Sprint("type-", i)); got != fmt.Sprint("type-", i) {
			t.Fatalf("type %d labelled %q", i, got)
		}
	}
	if got := m.eventType("one-too-many"); got != otherEventType {
		t.Errorf("event type past the cap labelled %q, want %q", got, otherEventType)
	}
	if got := m.eventType("type-7"); got != "type-7" {
		t.Errorf("known event type labelled %q", got)
	}
}

// TestRelayRegistersBesideJobMetrics: job_retry_total and job_dlq_total may
// already be registered by the job runtime; the relay reuses them.
func TestRelayRegistersBesideJobMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := newMetrics(reg, outboxconfig.SinkLog); err != nil {
		t.Fatal(err)
	}
	if _, err := newMetrics(reg, outboxconfig.SinkLog); err != nil {
		t.Fatalf("second relay on the same registry: %v", err)
	}
	reg2 := prometheus.NewRegistry()
	reg2.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "job_dlq_total", Help: "a clash"}))
	if _, err := newMetrics(reg2, outboxconfig.SinkLog); err == nil {
		t.Error("a clashing metric was accepted")
	}
}

// TestRelayRejectsBadConfig: NewRelay validates.
func TestRelayRejectsBadConfig(t *testing.T) {
	cfg := outboxconfig.DefaultConfig()
	cfg.BatchSize = 0
	if _, err := NewRelay(nil, &recorder{}, cfg, "x", nil, nil); err == nil {
		t.Error("batch_size 0 accepted")
	}
	if _, err := NewRelay(nil, &recorder{}, outboxconfig.DefaultConfig(), "x", nil, nil); err == nil {
		t.Error("nil pool accepted")
	}
}

// TestRelayStartTwice and a Shutdown before Start are harmless misuse.
func TestRelayStartTwice(t *testing.T) {
	db := pgtest.New(t)
	r, err := NewRelay(db.Pool, &recorder{}, testConfig(), "x", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Shutdown(context.Background()); err != nil {
		t.Errorf("Shutdown before Start: %v", err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err == nil {
		t.Error("second Start accepted")
	}
	if err := r.Shutdown(context.Background()); err != nil {
		t.Error(err)
	}
	if err := r.Shutdown(context.Background()); err != nil {
		t.Errorf("second Shutdown: %v", err)
	}
}

// TestRelayHardStopByContext: cancelling Start's context stops the relay
// like a Shutdown whose budget is gone: the hanging publish is cancelled and
// the event is handed back without using an attempt.
func TestRelayHardStopByContext(t *testing.T) {
	db := pgtest.New(t)
	id := appendEvent(t, db.Pool, "a", "hang")
	entered := make(chan struct{}, 1)
	rec := &recorder{fail: func(ctx context.Context, _ Event) error {
		entered <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}}
	r, err := NewRelay(db.Pool, rec, testConfig(), "x", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	<-entered
	cancel()
	if err := r.Shutdown(context.Background()); err != nil {
		t.Errorf("Shutdown after a hard stop: %v", err)
	}
	var status string
	var attempts int
	if err := db.Pool.QueryRow(context.Background(), `SELECT status, attempts FROM outbox_event_state WHERE event_id = $1`, id).
		Scan(&status, &attempts); err != nil {
		t.Fatal(err)
	}
	if status != StatusPending || attempts != 0 {
		t.Errorf("after a hard stop: %s with %d attempts, want PENDING with 0", status, attempts)
	}
}

// TestRelayRecordsRetryAfter: a Retry-After longer than the backoff sets
// the retry time.
func TestRelayRecordsRetryAfter(t *testing.T) {
	db := pgtest.New(t)
	id := appendEvent(t, db.Pool, "a", "busy")
	rec := &recorder{fail: func(context.Context, Event) error {
		return &RetryAfterError{Err: errors.New("429"), After: time.Hour}
	}}
	startRelay(t, db.Pool, rec, testConfig(), nil)
	testkit.Eventually(t, 10*time.Second, "the failure recorded", func() bool { return statusOf(t, db.Pool, id) == StatusFailed })
	var wait time.Duration
	var lastErr string
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT next_attempt_at - now(), last_error FROM outbox_event_state WHERE event_id = $1`, id).Scan(&wait, &lastErr); err != nil {
		t.Fatal(err)
	}
	if wait < 59*time.Minute || lastErr != "429" {
		t.Errorf("retry in %s (last_error %q), want about an hour", wait, lastErr)
	}
}

// TestRelayStoresAnyErrorText: error text that is not valid UTF-8 or holds a
// NUL byte still lands in last_error.
func TestRelayStoresAnyErrorText(t *testing.T) {
	if got := errorText(errors.New("bad \xff byte \x00 here")); got != "bad  byte  here" {
		t.Errorf("errorText = %q", got)
	}
	long := errorText(errors.New(string(make([]byte, 5000))))
	if len(long) != 0 {
		t.Errorf("NUL-only text kept %d bytes", len(long))
	}
	if n := len(errorText(errors.New(fmt.Sprintf("%5000s", "x")))); n != 2000 {
		t.Errorf("long error kept %d bytes, want 2000", n)
	}
	_ = json.Valid
}

// TestRelayRecoversWhenOutcomesCannotBeWritten: when writing a batch's
// outcomes fails, the batch rolls back (its events stay unpublished and are
// delivered again: at least once) and the relay carries on; once the write
// works again everything is published.
func TestRelayRecoversWhenOutcomesCannotBeWritten(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	exec(t, db.Pool, `
CREATE FUNCTION refuse_publish() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_event WHERE id = OLD.id AND event_type = 'refused') THEN
        RAISE EXCEPTION 'refused by test';
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER refuse_publish BEFORE DELETE ON outbox_delivery FOR EACH ROW EXECUTE FUNCTION refuse_publish();`)
	refused := appendEvent(t, db.Pool, "a", "refused")
	after := appendEvent(t, db.Pool, "a", "after")
	rec := &recorder{}
	cfg := testConfig()
	r, err := NewRelay(db.Pool, rec, cfg, "x", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := r.Shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	}()
	deliveries := func(id string) int {
		n := 0
		for _, e := range rec.delivered() {
			if e.EventID == id {
				n++
			}
		}
		return n
	}
	testkit.Eventually(t, 10*time.Second, "the refused batch delivered again", func() bool { return deliveries(refused) >= 3 })
	if s := statusOf(t, db.Pool, refused); s != StatusPending {
		t.Fatalf("refused event: %s", s)
	}
	exec(t, db.Pool, `DROP TRIGGER refuse_publish ON outbox_delivery`)
	testkit.Eventually(t, 10*time.Second, "everything published once the write works", func() bool {
		return statusOf(t, db.Pool, refused) == StatusPublished && statusOf(t, db.Pool, after) == StatusPublished
	})
	var order []string
	for _, e := range rec.delivered() {
		order = append(order, e.EventID)
	}
	// Redelivered, but never out of order: each delivery of the second
	// event follows a delivery of the first.
	for i, id := range order {
		if id == after && (i == 0 || order[i-1] != refused) {
			t.Fatalf("delivery order %v", order)
		}
	}
}
