package outbox

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

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// testConfig is DefaultConfig with fast retries and polling.
func testConfig() outboxconfig.Config {
	cfg := outboxconfig.DefaultConfig()
	cfg.PollInterval = 50 * time.Millisecond
	cfg.BackoffBase = 10 * time.Millisecond
	cfg.BackoffMax = 50 * time.Millisecond
	cfg.MetricsInterval = 100 * time.Millisecond
	return cfg
}

// startRelay starts a relay that is shut down when the test ends.
func startRelay(tb testing.TB, pool *pgxpool.Pool, sink Sink, cfg outboxconfig.Config, reg prometheus.Registerer) *Relay {
	tb.Helper()
	log := slog.New(slog.NewTextHandler(testWriter{tb}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r, err := NewRelay(pool, sink, cfg, "test-relay", log, reg)
	if err != nil {
		tb.Fatal(err)
	}
	startBuilt(tb, r, "test-relay")
	return r
}

// startBuilt starts r and shuts it down when the test ends.
func startBuilt(tb testing.TB, r *Relay, name string) {
	tb.Helper()
	if err := r.Start(context.Background()); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := r.Shutdown(ctx); err != nil {
			tb.Errorf("shutdown of %s: %v", name, err)
		}
	})
}

type testWriter struct{ tb testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.tb.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// recorder is a sink that records deliveries; fail, if set, decides each
// call's outcome.
type recorder struct {
	fail func(ctx context.Context, e Event) error

	mu     sync.Mutex
	events []Event
}

func (s *recorder) Name() string { return "recorder" }

func (s *recorder) Publish(ctx context.Context, e Event) error {
	if s.fail != nil {
		if err := s.fail(ctx, e); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.events = append(s.events, e)
	return nil
}

func (s *recorder) delivered() []Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Event(nil), s.events...)
}

func (s *recorder) has(eventID string) bool {
	for _, e := range s.delivered() {
		if e.EventID == eventID {
			return true
		}
	}
	return false
}

// appendEvent appends one event in its own transaction.
func appendEvent(tb testing.TB, pool *pgxpool.Pool, aggID, eventType string) string {
	tb.Helper()
	var id string
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		var err error
		id, err = Append(context.Background(), tx, NewEvent{
			AggregateType: "order", AggregateID: aggID, EventType: eventType,
			Payload: json.RawMessage(fmt.Sprintf(`{"aggregate": %q}`, aggID)),
		})
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

func statusOf(tb testing.TB, pool *pgxpool.Pool, eventID string) string {
	tb.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), "SELECT status FROM outbox_event_state WHERE event_id = $1", eventID).Scan(&s); err != nil {
		tb.Fatal(err)
	}
	return s
}

// setDelivery sets columns of the delivery row of the event eventID: set is
// the SET list, whose parameters start at $2.
func setDelivery(tb testing.TB, pool *pgxpool.Pool, eventID, set string, args ...any) {
	tb.Helper()
	tag, err := pool.Exec(context.Background(), "UPDATE outbox_delivery SET "+set+
		" WHERE id = (SELECT id FROM outbox_event_state WHERE event_id = $1)", append([]any{eventID}, args...)...)
	if err != nil {
		tb.Fatal(err)
	}
	if tag.RowsAffected() != 1 {
		tb.Fatalf("event %s has no delivery row", eventID)
	}
}

// publishedAt is when the event was published, from the record of
// outboxtest.RecordPublishes.
func publishedAt(tb testing.TB, pool *pgxpool.Pool, eventID string) time.Time {
	tb.Helper()
	var at time.Time
	if err := pool.QueryRow(context.Background(), `SELECT p.at FROM test_publish p JOIN outbox_event e ON e.id = p.id
		WHERE e.event_id = $1`, eventID).Scan(&at); err != nil {
		tb.Fatalf("when %s was published: %v", eventID, err)
	}
	return at
}

// markDead makes the events DEAD, as the relay would after their last
// attempt.
func markDead(tb testing.TB, pool *pgxpool.Pool, eventIDs ...string) {
	tb.Helper()
	for _, id := range eventIDs {
		setDelivery(tb, pool, id, "status = 'DEAD', attempts = 3, dead_at = now()")
	}
}

func exec(tb testing.TB, pool *pgxpool.Pool, sql string, args ...any) {
	tb.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		tb.Fatal(err)
	}
}
