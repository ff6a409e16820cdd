// Package inboxtest is what the inbox sources' tests share: a database
// with a real inbox.Consumer in front of it (Fixture), Handoff wrappers
// that record what a source did (States, Outcomes, Counting), a runner
// that stops a source and checks how it ended (RunSource), and the
// benchmark harness that sets a source's bare loop, the plain work and
// the inbox side by side (Bench). Only _test.go files import it.
package inboxtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// SeenSQL is the fixture's work: one row of the seen table per message
// processed, in order.
const SeenSQL = `INSERT INTO seen (id, order_key) VALUES (@id, @order_key)`

// Event is a message as the outbox's sinks send it: an aggregate's event
// with an id; no ID leaves the id attribute out.
type Event struct{ ID, Aggregate string }

// Events returns n events over aggs aggregates (agg-0, agg-1, ...), with
// ids prefix-0, prefix-1, ...
func Events(prefix string, n, aggs int) []Event {
	out := make([]Event, n)
	for i := range out {
		out[i] = Event{ID: fmt.Sprintf("%s-%d", prefix, i), Aggregate: fmt.Sprintf("agg-%d", i%aggs)}
	}
	return out
}

// Fixture is one test's inbox: a database with the seen table, and the
// configuration of source "orders" with the sql handler running SeenSQL.
// The test fills in the source's own section (Src.NATS, Src.Kafka, ...).
type Fixture struct {
	T      testing.TB
	DB     *pgtest.DB
	Src    inboxconfig.SourceConfig
	Cfg    inboxconfig.Config
	States *States // the Up and Down reports of the sources Run started
}

// NewFixture returns a fixture for a source of kind, with short backoffs.
func NewFixture(t testing.TB, kind string) *Fixture {
	t.Helper()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE seen (n bigserial, id text NOT NULL, order_key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg := inboxconfig.DefaultConfig()
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 100*time.Millisecond
	cfg.ProbeBackoffMax = 200 * time.Millisecond
	src := inboxconfig.DefaultSource()
	src.Name, src.Kind = "orders", kind
	src.Handler = inboxconfig.HandlerConfig{Kind: inboxconfig.HandlerSQL, SQL: SeenSQL}
	return &Fixture{T: t, DB: db, Src: src, Cfg: cfg, States: &States{}}
}

// Consumer returns an inbox consumer of the fixture's source with handler
// h (the sql handler when nil).
func (f *Fixture) Consumer(h inbox.Handler) *inbox.Consumer {
	if h == nil {
		h = inbox.SQLHandler{SQL: f.Src.Handler.SQL}
	}
	return NewConsumer(f.T, f.DB.Pool, f.Src, f.Cfg, h, prometheus.NewRegistry())
}

// Run runs s in front of h until the test ends, reporting its state
// changes to f.States; see RunSource.
func (f *Fixture) Run(s inbox.Source, h inbox.Handoff) (stop func() error) {
	f.T.Helper()
	return RunSource(f.T, s, &Reporting{Handoff: h, States: f.States})
}

// Counts returns how many times each id's work ran.
func (f *Fixture) Counts() map[string]int {
	f.T.Helper()
	rows, err := f.DB.Pool.Query(context.Background(), `SELECT id, count(*) FROM seen GROUP BY id`)
	if err != nil {
		f.T.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			f.T.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		f.T.Fatal(err)
	}
	return out
}

// Scalar runs a query returning one number.
func (f *Fixture) Scalar(sql string, args ...any) int {
	f.T.Helper()
	return Scalar(f.T, f.DB.Pool, sql, args...)
}

// WaitDone waits until n messages are finished in the inbox.
func (f *Fixture) WaitDone(n int) {
	f.T.Helper()
	testkit.Eventually(f.T, 60*time.Second, fmt.Sprintf("%d messages finished in the inbox", n), func() bool {
		return f.Scalar(`SELECT count(*) FROM inbox_message WHERE state IN ('PROCESSED', 'DEAD')`) >= n
	})
}

// ExactlyOnce checks that the work of every event of evs ran exactly
// once, and no other work ran.
func (f *Fixture) ExactlyOnce(evs []Event) {
	f.T.Helper()
	counts := f.Counts()
	for _, e := range evs {
		if counts[e.ID] != 1 {
			f.T.Errorf("message %s processed %d times, want 1", e.ID, counts[e.ID])
		}
	}
	if len(counts) != len(evs) {
		f.T.Errorf("%d ids processed, want %d", len(counts), len(evs))
	}
}

// ClaimedElsewhere inserts id's inbox row as another replica's claim
// whose lease ends after lease.
func (f *Fixture) ClaimedElsewhere(id string, lease time.Duration) {
	f.T.Helper()
	_, err := f.DB.Pool.Exec(context.Background(), `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, owner, lease_token, lease_until)
VALUES ($1, 'order', $2, 'RECEIVED', 'another-replica', 1, now() + $3::interval)`, f.Src.Name, id, lease)
	if err != nil {
		f.T.Fatal(err)
	}
}

// Reset empties the inbox and the seen table, between benchmark phases.
func (f *Fixture) Reset() {
	for _, q := range []string{"TRUNCATE inbox_message, seen", "VACUUM ANALYZE inbox_message", "VACUUM ANALYZE seen"} {
		if _, err := f.DB.Pool.Exec(context.Background(), q); err != nil {
			f.T.Fatal(err)
		}
	}
}

// NewConsumer returns a consumer of src on pool, with its metrics on reg;
// its log is printed when the test fails.
func NewConsumer(t testing.TB, pool *pgxpool.Pool, src inboxconfig.SourceConfig, cfg inboxconfig.Config, h inbox.Handler, reg prometheus.Registerer) *inbox.Consumer {
	t.Helper()
	return newConsumer(t, pool, src, cfg, h, reg, "test-instance")
}

// NewConsumerOn is NewConsumer for a replica called owner, with metrics
// of its own.
func NewConsumerOn(t testing.TB, pool *pgxpool.Pool, src inboxconfig.SourceConfig, cfg inboxconfig.Config, h inbox.Handler, owner string) *inbox.Consumer {
	t.Helper()
	return newConsumer(t, pool, src, cfg, h, prometheus.NewRegistry(), owner)
}

func newConsumer(t testing.TB, pool *pgxpool.Pool, src inboxconfig.SourceConfig, cfg inboxconfig.Config, h inbox.Handler, reg prometheus.Registerer, owner string) *inbox.Consumer {
	m, err := inbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testkit.LogBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("consumer log:\n%s", logs.String())
		}
	})
	return inbox.NewConsumer(pool, src, cfg, h, owner, logs.Logger(), m)
}

// Scalar runs a query returning one number.
func Scalar(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// RunSource runs s in front of h until the test ends. The stop function
// it returns ends Run, waits for it (30s at most) and returns its error;
// when the test ends, a Run that did not return nil fails it.
func RunSource(t testing.TB, s inbox.Source, h inbox.Handoff) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx, h) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-errc:
			case <-time.After(30 * time.Second):
				runErr = errors.New("Run did not return within 30s of its context ending")
			}
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return stop
}

// CheckSetupError runs s in front of h, and checks that Run ends with
// want, naming key, and that the error does not contain secret.
func CheckSetupError(t testing.TB, s inbox.Source, h inbox.Handoff, want error, key, secret string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := s.Run(ctx, h)
	if !errors.Is(err, want) || !strings.Contains(fmt.Sprint(err), key) {
		t.Errorf("Run = %v; want %v naming %s", err, want, key)
	}
	if strings.Contains(fmt.Sprint(err), secret) {
		t.Errorf("the password is in the error: %v", err)
	}
}
