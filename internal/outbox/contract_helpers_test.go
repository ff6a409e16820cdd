package outbox_test

// Shared scaffolding of the outbox contract tests (contract_*_test.go). They
// are black-box: they drive the relay through its public API, produce events
// through the real insert trigger, and read the events' state with plain
// SQL (the view outbox_event_state).

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// contractAggregateType is the aggregate_type of every event the contract
// tests produce.
const contractAggregateType = "order"

// contractConfig is DefaultConfig with test-friendly timings: fast retries,
// and a poll interval long enough that a test proving NOTIFY wake-ups is not
// rescued by polling, short enough that the others don't wait on it.
func contractConfig() outboxconfig.Config {
	cfg := outboxconfig.DefaultConfig()
	cfg.PollInterval = 200 * time.Millisecond
	cfg.BackoffBase = 10 * time.Millisecond
	cfg.BackoffMax = 50 * time.Millisecond
	return cfg
}

// contractStartRelay builds and starts a relay and shuts it down when the
// test ends (before the pool closes: cleanups run last-in first-out).
func contractStartRelay(t testing.TB, pool *pgxpool.Pool, sink outbox.Sink, cfg outboxconfig.Config, instanceID string, log *slog.Logger, reg prometheus.Registerer) *outbox.Relay {
	t.Helper()
	if log == nil {
		log = contractTestLogger(t)
	}
	r, err := outbox.NewRelay(pool, sink, cfg, instanceID, log, reg)
	if err != nil {
		t.Fatalf("NewRelay: %v", err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown %s: %v", instanceID, err)
		}
	})
	return r
}

// contractTestLogger routes the relay's warnings and errors to the test
// log, where they explain a failure.
func contractTestLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(contractTestWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type contractTestWriter struct{ t testing.TB }

func (w contractTestWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// contractAppend appends one event of aggregate aggID in its own
// transaction through outbox.Append and returns its event_id.
func contractAppend(t testing.TB, pool *pgxpool.Pool, aggID, eventType string) string {
	t.Helper()
	return contractAppendInOneTx(t, pool, contractNewEvent(aggID, eventType))[0]
}

// contractAppendInOneTx appends events in one transaction, so the relay
// sees them all at once, and returns their event_ids.
func contractAppendInOneTx(t testing.TB, pool *pgxpool.Pool, events ...outbox.NewEvent) []string {
	t.Helper()
	var ids []string
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		for _, e := range events {
			id, err := outbox.Append(context.Background(), tx, e)
			if err != nil {
				return fmt.Errorf("append %s/%s: %w", e.AggregateID, e.EventType, err)
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func contractNewEvent(aggID, eventType string) outbox.NewEvent {
	return outbox.NewEvent{
		AggregateType: contractAggregateType,
		AggregateID:   aggID,
		EventType:     eventType,
		Payload:       json.RawMessage(fmt.Sprintf(`{"aggregate":%q,"type":%q}`, aggID, eventType)),
	}
}

// contractRow is the relay-visible state of one event, as the view
// outbox_event_state shows it.
type contractRow struct {
	ID          int64
	EventID     string
	AggregateID string
	Status      string
	// Attempts of an event still to publish, or DEAD; 0 for a PUBLISHED
	// event, whose delivery row (and with it its attempts) is deleted when
	// it is published. How many attempts a publication took is read from
	// the sink instead: contractRecordingSink.publishedOnAttempt.
	Attempts int
}

// contractRows returns every event in id (insertion) order.
func contractRows(t testing.TB, pool *pgxpool.Pool) []contractRow {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT id, coalesce(event_id::text, ''), aggregate_id, status, coalesce(attempts, 0) FROM outbox_event_state ORDER BY id`)
	if err != nil {
		t.Fatalf("read outbox_event: %v", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (contractRow, error) {
		var c contractRow
		err := r.Scan(&c.ID, &c.EventID, &c.AggregateID, &c.Status, &c.Attempts)
		return c, err
	})
	if err != nil {
		t.Fatalf("read outbox_event: %v", err)
	}
	return out
}

// contractRowOf returns the row of one event.
func contractRowOf(t testing.TB, pool *pgxpool.Pool, eventID string) contractRow {
	t.Helper()
	var c contractRow
	err := pool.QueryRow(context.Background(),
		`SELECT id, coalesce(event_id::text, ''), aggregate_id, status, coalesce(attempts, 0) FROM outbox_event_state WHERE event_id = $1`, eventID).
		Scan(&c.ID, &c.EventID, &c.AggregateID, &c.Status, &c.Attempts)
	if err != nil {
		t.Fatalf("read event %s: %v", eventID, err)
	}
	return c
}

// contractStatusOf is the status of one event, for polling.
func contractStatusOf(t testing.TB, pool *pgxpool.Pool, eventID string) string {
	t.Helper()
	return contractRowOf(t, pool, eventID).Status
}

// contractCountStatus counts the rows in status.
func contractCountStatus(t testing.TB, pool *pgxpool.Pool, status string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(),
		`SELECT count(*) FROM outbox_event_state WHERE status = $1`, status).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", status, err)
	}
	return n
}

// contractDelivery is one successful Publish as the sink saw it.
type contractDelivery struct {
	Event outbox.Event
	At    time.Time
}

// contractRecordingSink records every call and every successful delivery,
// in arrival order, per aggregate and per event_id. behave, if set, decides
// the outcome of each call (call is 1 for an event's first call); it runs
// outside the sink's lock, so it may block.
type contractRecordingSink struct {
	behave func(ctx context.Context, e outbox.Event, call int) error

	mu          sync.Mutex
	calls       []outbox.Event            // every Publish, in arrival order
	callsByID   map[string]int            // Publish calls per event_id
	delivered   []contractDelivery        // successful Publishes, in order
	byAggregate map[string][]outbox.Event // successful Publishes per aggregate
	okByID      map[string]int            // successful Publishes per event_id
}

func newContractRecordingSink(behave func(ctx context.Context, e outbox.Event, call int) error) *contractRecordingSink {
	return &contractRecordingSink{
		behave:      behave,
		callsByID:   map[string]int{},
		byAggregate: map[string][]outbox.Event{},
		okByID:      map[string]int{},
	}
}

func (s *contractRecordingSink) Name() string { return "contract-recorder" }

func (s *contractRecordingSink) Publish(ctx context.Context, e outbox.Event) error {
	s.mu.Lock()
	s.calls = append(s.calls, e)
	s.callsByID[e.EventID]++
	call := s.callsByID[e.EventID]
	s.mu.Unlock()
	if s.behave != nil {
		if err := s.behave(ctx, e, call); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.delivered = append(s.delivered, contractDelivery{Event: e, At: time.Now()})
	s.byAggregate[e.AggregateID] = append(s.byAggregate[e.AggregateID], e)
	s.okByID[e.EventID]++
	return nil
}

// deliveredCount is the number of successful Publishes of eventID.
func (s *contractRecordingSink) deliveredCount(eventID string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.okByID[eventID]
}

// publishedOnAttempt is the attempt, counting from 1, on which eventID
// was last delivered (the delivery the relay recorded as its publication):
// one more than the Event.Attempts, the attempts the relay had counted
// before, that the successful Publish carried; 0 if it was never
// delivered. A PUBLISHED event keeps no attempts in the outbox, so this is
// where a test reads what its publication cost.
func (s *contractRecordingSink) publishedOnAttempt(eventID string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.delivered) - 1; i >= 0; i-- {
		if e := s.delivered[i].Event; e.EventID == eventID {
			return e.Attempts + 1
		}
	}
	return 0
}

// callCount is the number of Publish calls for eventID.
func (s *contractRecordingSink) callCount(eventID string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.callsByID[eventID]
}

// distinctDelivered is the number of distinct events delivered.
func (s *contractRecordingSink) distinctDelivered() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.okByID)
}

// deliveries returns a copy of the successful Publishes, in arrival order.
func (s *contractRecordingSink) deliveries() []contractDelivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]contractDelivery(nil), s.delivered...)
}

// allCalls returns a copy of every Publish call, in arrival order.
func (s *contractRecordingSink) allCalls() []outbox.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]outbox.Event(nil), s.calls...)
}

// deliveredAt returns when eventID was first delivered.
func (s *contractRecordingSink) deliveredAt(eventID string) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.delivered {
		if d.Event.EventID == eventID {
			return d.At, true
		}
	}
	return time.Time{}, false
}

// contractJSONLogger is the production JSON logger writing into a buffer.
func contractJSONLogger(t testing.TB) (*slog.Logger, *testkit.LogBuffer) {
	t.Helper()
	buf := &testkit.LogBuffer{}
	log, err := obs.NewLogger(buf, "json", "debug", "contract-test")
	if err != nil {
		t.Fatal(err)
	}
	return log, buf
}

// contractBackendWaitingOnLock reports whether the backend pid is blocked
// on a heavyweight lock (advisory locks included).
func contractBackendWaitingOnLock(t testing.TB, pool *pgxpool.Pool, pid uint32) bool {
	t.Helper()
	var waiting bool
	err := pool.QueryRow(context.Background(),
		`SELECT coalesce(bool_or(wait_event_type = 'Lock'), false) FROM pg_stat_activity WHERE pid = $1`,
		int64(pid)).Scan(&waiting)
	if err != nil {
		t.Fatalf("pg_stat_activity: %v", err)
	}
	return waiting
}
