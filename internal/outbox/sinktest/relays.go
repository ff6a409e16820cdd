package sinktest

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// helperDatabaseEnv carries the database URL to the relay child process;
// without it RelayProcess returns at once.
const helperDatabaseEnv = "WORKER_SINKTEST_DATABASE_URL"

// helperSlowEnv makes the child hold each event a while after the broker
// confirmed it, before the relay may mark it, so that a SIGKILL lands
// between the broker's confirmation and the relay's commit, as a crash in
// production would.
const helperSlowEnv = "WORKER_SINKTEST_SLOW"

// slowAck is that while.
const slowAck = 200 * time.Millisecond

// RelayConfig is the relays' configuration in RelayRun: quick retries and
// enough attempts that a broker outage costs retries, never events.
func RelayConfig() outboxconfig.Config {
	cfg := outboxconfig.DefaultConfig()
	cfg.BatchSize = 100
	cfg.PollInterval = 50 * time.Millisecond
	cfg.InFlightTimeout = 10 * time.Second
	cfg.MaxAttempts = 1000
	cfg.BackoffBase = 10 * time.Millisecond
	cfg.BackoffMax = 200 * time.Millisecond
	cfg.MetricsInterval = time.Second
	return cfg
}

// Relays describes RelayRun's setting.
type Relays struct {
	Broker Broker
	// HelperTest is the test in the sink's package that calls RelayProcess;
	// ChildEnv is what it needs to build the same sink.
	HelperTest string
	ChildEnv   []string
	// Disrupt takes the broker away mid-run and brings it back: stops and
	// starts it, or closes every connection from its side.
	Disrupt func(t *testing.T)
	// Dedup is true when the broker drops a message id it already holds, so
	// every event is held exactly once despite redeliveries.
	Dedup bool
	// Events over Aggregates (defaults 20,000 and 200).
	Events, Aggregates int
}

// RelayRun inserts Events over Aggregates, runs three relays in two
// processes (two loops here, one in a child process), SIGKILLs the child
// in the middle of a batch and starts another, disrupts the broker, and
// then reads everything back: every event present, first deliveries in
// per-aggregate order, message id = event_id, CloudEvents attributes right,
// and with Dedup every event exactly once although the killed batch was
// published again.
func RelayRun(t *testing.T, r Relays) {
	events, aggregates := cmp.Or(r.Events, 20000), cmp.Or(r.Aggregates, 200)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'Order', 'agg-' || (g % $2), 'order.updated', jsonb_build_object('n', g),
       jsonb_build_object('traceparent', '00-' || lpad(to_hex(g), 32, '0') || '-' || lpad(to_hex(g), 16, '0') || '-01')
FROM generate_series(1, $1) g ORDER BY g`, events, aggregates); err != nil {
		t.Fatal(err)
	}
	want := storedEvents(t, db.Pool)

	// The child starts first: on a busy machine its start (a process, a
	// connection reservation, a broker client) can take longer than the
	// parent needs to publish everything, and then no batch of its is left
	// to kill. The parent joins once the child publishes.
	first := startChild(t, r, db, helperSlowEnv+"=1")
	testkit.Eventually(t, 2*time.Minute, "the child relay to publish", func() bool { return first.count() >= 1 })
	parent := &acks{}
	cfg := RelayConfig()
	cfg.Relays = 2
	startRelay(t, db.Pool, parent.wrap(r.Broker.New(t)), cfg, "parent")
	testkit.Eventually(t, time.Minute, "the child relay to publish 30 events", func() bool { return first.count() >= 30 })
	first.kill(t)
	second := startChild(t, r, db)

	testkit.Eventually(t, 2*time.Minute, "half of the events published", func() bool {
		return countPublished(t, db.Pool) >= events/2
	})
	if r.Disrupt != nil {
		r.Disrupt(t)
	}
	testkit.Eventually(t, 3*time.Minute, "every event published", func() bool {
		return countPublished(t, db.Pool) == events
	})
	second.stop(t)
	if n := countStatus(t, db.Pool, outbox.StatusDead); n != 0 {
		t.Errorf("%d events DEAD, want none", n)
	}
	// The killed batch: events the killed child had published whose
	// outcome it never recorded, so another relay published them again.
	again := map[string]bool{}
	for _, id := range append(parent.ids(), second.ids()...) {
		again[id] = true
	}
	var killedBatch []string
	for _, id := range first.ids() {
		if again[id] {
			killedBatch = append(killedBatch, id)
		}
	}
	if len(killedBatch) == 0 {
		t.Fatalf("the kill missed the batch: none of the %d events the killed child published was published again", first.count())
	}
	t.Logf("acks: parent %d, first child %d (%d of them published again), second child %d",
		parent.count(), first.count(), len(killedBatch), second.count())

	msgs := r.Broker.Read(t)
	held := map[string]int{}
	lastSeq := map[string]int64{}
	for _, m := range msgs {
		e, ok := want[m.ID]
		if !ok {
			t.Errorf("message id %q is no event_id of this test", m.ID)
			continue
		}
		held[m.ID]++
		if held[m.ID] > 1 {
			continue // a redelivery: order is judged on first deliveries
		}
		CheckMessage(t, m, e.Event)
		if e.Seq <= lastSeq[e.AggregateID] {
			t.Errorf("aggregate %s: first delivery of seq %d after seq %d", e.AggregateID, e.Seq, lastSeq[e.AggregateID])
		}
		lastSeq[e.AggregateID] = e.Seq
	}
	for id := range want {
		if held[id] == 0 {
			t.Errorf("event %s is missing on the broker", id)
		}
	}
	if r.Dedup {
		for _, id := range killedBatch {
			if held[id] != 1 {
				t.Errorf("event %s of the killed batch is held %d times, want once", id, held[id])
			}
		}
		if len(msgs) != events {
			t.Errorf("the broker holds %d messages for %d events: redeliveries were not dropped", len(msgs), events)
		}
	}
}

// storedEvent is an outbox row as the broker must show it.
type storedEvent struct{ outbox.Event }

func storedEvents(t *testing.T, pool *pgxpool.Pool) map[string]storedEvent {
	rows, err := pool.Query(t.Context(), `
SELECT id, event_id::text, aggregate_type, aggregate_id, event_type, payload::text, headers, occurred_at FROM outbox_event_state`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]storedEvent{}
	for rows.Next() {
		var e outbox.Event
		var payload string
		if err := rows.Scan(&e.Seq, &e.EventID, &e.AggregateType, &e.AggregateID, &e.EventType, &payload, &e.Headers, &e.OccurredAt); err != nil {
			t.Fatal(err)
		}
		e.Payload = []byte(payload)
		out[e.EventID] = storedEvent{e}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func status(t *testing.T, pool *pgxpool.Pool, eventID string) string {
	var s string
	if err := pool.QueryRow(t.Context(), `SELECT status FROM outbox_event_state WHERE event_id = $1`, eventID).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func countStatus(t *testing.T, pool *pgxpool.Pool, s string) int {
	var n int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox_event_state WHERE status = $1`, s).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func countPublished(t *testing.T, pool *pgxpool.Pool) int {
	return countStatus(t, pool, outbox.StatusPublished)
}

// startRelay runs a relay on s until the test ends, then closes s.
func startRelay(t *testing.T, pool *pgxpool.Pool, s outbox.Sink, cfg outboxconfig.Config, id string) {
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r, err := outbox.NewRelay(pool, s, cfg, id, log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		closeSink(t, s)
	})
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// acks wraps a sink to record the event_ids it published; with out set it
// also prints "published <id>" there, for a parent process to read.
type acks struct {
	out  *os.File
	hold time.Duration // after each confirmation, before returning nil

	mu  sync.Mutex
	log []string
}

func (a *acks) wrap(s outbox.Sink) outbox.Sink { return &ackingSink{Sink: s, acks: a} }

func (a *acks) add(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.log = append(a.log, id)
	if a.out != nil {
		fmt.Fprintf(a.out, "published %s\n", id)
	}
}

func (a *acks) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.log)
}

func (a *acks) ids() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.log...)
}

type ackingSink struct {
	outbox.Sink
	acks *acks
}

func (s *ackingSink) Publish(ctx context.Context, e outbox.Event) error {
	err := s.Sink.Publish(ctx, e)
	if err == nil {
		s.acks.add(e.EventID)
		if s.acks.hold > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(s.acks.hold):
			}
		}
	}
	return err
}

// Close passes the sink's optional Close through the wrapper.
func (s *ackingSink) Close(ctx context.Context) error {
	if c, ok := s.Sink.(interface{ Close(context.Context) error }); ok {
		return c.Close(ctx)
	}
	return nil
}

// child is a relay process started by RelayRun.
type child struct {
	cmd     *exec.Cmd
	stderr  bytes.Buffer
	done    chan struct{}
	release func() // its connection slots
	acks
}

func startChild(t *testing.T, r Relays, db *pgtest.DB, env ...string) *child {
	c := &child{done: make(chan struct{})}
	childURL, release := db.ChildURL(t, 4, 1) // the relay's pool and its listener
	c.release = release
	c.cmd = exec.Command(os.Args[0], "-test.run=^"+r.HelperTest+"$", "-test.count=1", "-test.timeout=10m")
	c.cmd.Env = append(append(append(os.Environ(), helperDatabaseEnv+"="+childURL), r.ChildEnv...), env...)
	c.cmd.Stderr = &c.stderr
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(c.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if id, ok := strings.CutPrefix(sc.Text(), "published "); ok {
				c.add(id)
			}
		}
	}()
	t.Cleanup(func() {
		_ = c.cmd.Process.Kill()
		<-c.done
		_ = c.cmd.Wait()
		if t.Failed() {
			t.Logf("child relay stderr:\n%s", c.stderr.String())
		}
	})
	return c
}

// kill SIGKILLs the child and waits for it.
func (c *child) kill(t *testing.T) {
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-c.done
	_ = c.cmd.Wait()
	c.release()
}

// stop asks the child to shut down (SIGTERM) and waits for a clean exit.
func (c *child) stop(t *testing.T) {
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-c.done
	if err := c.cmd.Wait(); err != nil {
		t.Errorf("child relay: %v\n%s", err, c.stderr.String())
	}
	c.release()
}

// RelayProcess is the body of RelayRun's child process: one relay loop on
// the sink newSink builds from the environment, printing each published
// event_id on stdout, until SIGTERM. Outside a child it returns at once.
func RelayProcess(t *testing.T, newSink func(t *testing.T) outbox.Sink) {
	url := os.Getenv(helperDatabaseEnv)
	if url == "" {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	a := &acks{out: os.Stdout}
	if os.Getenv(helperSlowEnv) != "" {
		a.hold = slowAck
	}
	s := a.wrap(newSink(t))
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r, err := outbox.NewRelay(pool, s, RelayConfig(), "child", log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Minute): // an orphaned child must not live on
		t.Fatal("relay process was never stopped")
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	closeSink(t, s)
}
