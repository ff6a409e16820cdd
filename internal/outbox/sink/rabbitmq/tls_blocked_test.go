package rabbitmq

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// target declares a topic exchange and a bound queue on the node.
func (n *privateNode) target(t *testing.T, binding string) target {
	t.Helper()
	conn, err := amqp.Dial(n.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return declareTarget(t, conn, n.url, binding)
}

// TestTLS: the sink publishes over amqps:// to a listener that requires a
// client certificate (verify_peer, fail_if_no_peer_cert), trusting the CA
// in tls_ca_file.
func TestTLS(t *testing.T) {
	t.Parallel()
	n := usePrivateNode(t, false)
	tg := n.target(t, "#")
	tlsConfig := func() outboxconfig.RabbitMQConfig {
		c := tg.config()
		c.URL = n.tlsURL
		c.TLSCAFile, c.TLSCertFile, c.TLSKeyFile = n.certs.ca, n.certs.clientCert, n.certs.clientKey
		return c
	}

	t.Run("publishes with a client certificate", func(t *testing.T) {
		s := connect(t, tlsConfig())
		e := sinktest.Event("tls", 0)
		if err := s.Publish(t.Context(), e); err != nil {
			t.Fatal(err)
		}
		msgs := tg.read(t)
		if len(msgs) != 1 {
			t.Fatalf("the queue holds %d messages, want 1", len(msgs))
		}
		sinktest.CheckMessage(t, msgs[0], e)
	})

	// Startup exits 78 on broker.ErrSetup: retrying for connect_timeout
	// would not make the certificate trusted.
	t.Run("a broker certificate the CA did not sign fails Connect at once", func(t *testing.T) {
		c := tlsConfig()
		c.TLSCAFile = n.certs.otherCA
		err := connectErr(t, c, time.Minute)
		if !errors.Is(err, broker.ErrSetup) || !strings.Contains(err.Error(), "outbox.rabbitmq.tls_ca_file") ||
			!strings.Contains(err.Error(), "certificate signed by unknown authority") {
			t.Errorf("got %v, want a setup error naming outbox.rabbitmq.tls_ca_file", err)
		}
		if strings.Contains(err.Error(), "guest:guest") {
			t.Errorf("the error quotes the password: %v", err)
		}
	})

	// The broker closes the handshake, which looks like a lost connection:
	// retried for connect_timeout, then startup exits 69.
	t.Run("without a client certificate the broker refuses the connection", func(t *testing.T) {
		c := tlsConfig()
		c.TLSCertFile, c.TLSKeyFile = "", ""
		if err := connectErr(t, c, time.Second); !errors.Is(err, broker.ErrUnreachable) {
			t.Errorf("got %v, want unreachable", err)
		}
	})
}

// connectErr connects a sink with cfg within budget and returns the error.
func connectErr(t *testing.T, cfg outboxconfig.RabbitMQConfig, budget time.Duration) error {
	t.Helper()
	s, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), budget)
	defer cancel()
	err = s.Connect(ctx)
	_ = s.Close(context.Background())
	if err == nil {
		t.Fatal("Connect succeeded")
	}
	return err
}

// The client speaks TLS only to an amqps:// URL: TLS files with amqp://
// would leave the connection in plain text.
func TestTLSFilesNeedAMQPS(t *testing.T) {
	t.Parallel()
	cfg := outboxconfig.DefaultRabbitMQConfig()
	cfg.URL, cfg.TLSCAFile = "amqp://guest:guest@127.0.0.1:5672/", testkit.NewCA(t, t.TempDir(), "ca").File
	if _, err := New(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "amqps://") || strings.Contains(err.Error(), "guest:guest") {
		t.Errorf("got %v, want an error asking for amqps://", err)
	}
}

// breakerOpenMsg is the relay's warning when its breaker opens.
const breakerOpenMsg = "outbox sink unavailable; claiming stops, events wait with their attempts untouched, one event probes the sink until it answers"

// blockedMsg is the sink's warning when the broker blocks its connection.
const blockedMsg = "rabbitmq blocked the connection (a memory or disk alarm); publishes are retried until it unblocks"

// TestBlocked raises a memory alarm on the private node, which blocks
// every publishing connection (connection.blocked). A publish fails as
// Unavailable within publish_timeout, then at once with a RetryAfterError
// naming the cause, and the sink logs the block once. A relay publishing
// through the alarm opens its breaker on it, loses nothing and spends no
// attempt: once the alarm clears every event is on the queue, first
// deliveries in per-aggregate order, and an event is held twice only if it
// was attempted twice.
func TestBlocked(t *testing.T) {
	t.Parallel()
	n := usePrivateNode(t, true) // the alarm blocks every publisher on the node
	const aggregates, before, during = 20, 500, 1500

	db := pgtest.New(t)
	tg := n.target(t, "#")
	cfg := tg.config()
	relayLog := &testkit.LogBuffer{}
	log := slog.New(slog.NewJSONHandler(relayLog, &slog.HandlerOptions{Level: slog.LevelInfo}))
	s, err := New(cfg, Options{Name: "relay", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	rcfg := sinktest.RelayConfig()
	// The default attempts: an alarm of any length must spend none.
	rcfg.MaxAttempts, rcfg.BackoffBase, rcfg.BackoffMax = 3, 100*time.Millisecond, time.Second
	rcfg.ProbeBackoffMax = 200 * time.Millisecond
	spent := newAttemptSink(s)
	startRelay(t, db.Pool, spent, rcfg, log)

	insertEvents(t, db.Pool, before, aggregates)
	testkit.Eventually(t, time.Minute, "the events before the alarm published", func() bool {
		return countStatus(t, db.Pool, outbox.StatusPublished) == before
	})

	alarmStart := time.Now()
	clearAlarm := n.raiseMemoryAlarm(t)
	probeBlocked(t, n)

	insertEvents(t, db.Pool, during, aggregates)
	// The first publish on the blocked connection waits out its
	// publish_timeout and opens the breaker; the probes then find the
	// connection blocked.
	testkit.Eventually(t, time.Minute, "the relay's breaker to open and the sink to see the block", func() bool {
		return len(relayLog.Lines(t, breakerOpenMsg)) > 0 && len(relayLog.Lines(t, blockedMsg)) > 0
	})
	clearAlarm()
	alarm := time.Since(alarmStart)

	testkit.Eventually(t, 2*time.Minute, "every event published", func() bool {
		return countStatus(t, db.Pool, outbox.StatusPublished) == before+during
	})
	if dead := countStatus(t, db.Pool, outbox.StatusDead); dead != 0 {
		t.Errorf("%d events DEAD after an alarm of %s", dead, alarm)
	}
	if n := spent.count(); n != 0 {
		t.Errorf("%d events spent attempts on the alarm, want none", n)
	}
	if warned := relayLog.Lines(t, blockedMsg); len(warned) != 1 || warned[0]["reason"] != "low on memory" {
		t.Errorf("blocked warnings: %v, want one with reason \"low on memory\"", warned)
	}
	if len(relayLog.Lines(t, "rabbitmq unblocked the connection")) != 1 {
		t.Error("no line says the connection was unblocked")
	}
	// A copy beyond the first comes only from a publish whose confirm the
	// alarm withheld: one in flight per aggregate when it began.
	checkDeliveries(t, tg.read(t), storedRows(t, db.Pool), aggregates)
}

// probeBlocked publishes through a sink of its own while the alarm is on:
// the broker blocks its connection on the first message, which then times
// out; the next publish fails at once, Unavailable with a RetryAfterError.
func probeBlocked(t *testing.T, n *privateNode) {
	t.Helper()
	cfg := n.target(t, "#").config()
	log := &testkit.LogBuffer{}
	s, err := New(cfg, Options{Name: "probe", Logger: log.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Connect(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	for i := range 3 {
		err := boundedPublish(t, s, sinktest.Event("probe", i), cfg.PublishTimeout)
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Fatalf("publish #%d while blocked: got %v, want Unavailable", i, err)
		}
		var ra *outbox.RetryAfterError
		if errors.As(err, &ra) {
			if ra.After < time.Second || !strings.Contains(err.Error(), "low on memory") {
				t.Errorf("got %v (retry after %s), want the cause and at least 1s", err, ra.After)
			}
			if len(log.Lines(t, blockedMsg)) != 1 {
				t.Errorf("the probe logged %q %d times, want once", blockedMsg, len(log.Lines(t, blockedMsg)))
			}
			return
		}
	}
	t.Fatal("no RetryAfterError while the broker blocks the connection")
}

// boundedPublish publishes e without a deadline of its own and fails the
// test if the sink's publish_timeout does not end the call.
func boundedPublish(t *testing.T, s *Sink, e outbox.Event, publishTimeout time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.Publish(context.Background(), e) }()
	select {
	case err := <-done:
		return err
	case <-time.After(publishTimeout + 10*time.Second): // generous: the machine may be busy
		t.Fatalf("Publish still running %s after publish_timeout=%s", 10*time.Second, publishTimeout)
		return nil
	}
}

// startRelay connects s and runs a relay on it until the test ends.
func startRelay(t *testing.T, pool *pgxpool.Pool, s *attemptSink, cfg outboxconfig.Config, log *slog.Logger) {
	t.Helper()
	r, err := outbox.NewRelay(pool, s, cfg, "blocked", log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Connect(t.Context()); err != nil {
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
		_ = s.Close(ctx)
	})
}

// insertEvents appends events spread over aggregates, in order.
func insertEvents(t *testing.T, pool *pgxpool.Pool, events, aggregates int) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT 'Order', 'agg-' || (g % $2), 'order.updated', jsonb_build_object('n', g)
FROM generate_series(1, $1) g ORDER BY g`, events, aggregates); err != nil {
		t.Fatal(err)
	}
}

func countStatus(t *testing.T, pool *pgxpool.Pool, status string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox_event_state WHERE status = $1`, status).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// storedRow is what the delivery check needs of an outbox row.
type storedRow struct {
	seq       int64
	aggregate string
}

func storedRows(t *testing.T, pool *pgxpool.Pool) map[string]storedRow {
	t.Helper()
	rows, err := pool.Query(t.Context(), `SELECT event_id::text, id, aggregate_id FROM outbox_event_state`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]storedRow{}
	for rows.Next() {
		var id string
		var r storedRow
		if err := rows.Scan(&id, &r.seq, &r.aggregate); err != nil {
			t.Fatal(err)
		}
		out[id] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkDeliveries: every event on the queue, first deliveries in
// per-aggregate order, no event held more than twice, and at most maxAgain
// held twice.
func checkDeliveries(t *testing.T, msgs []sinktest.Message, want map[string]storedRow, maxAgain int) {
	t.Helper()
	held := map[string]int{}
	last := map[string]int64{}
	for _, m := range msgs {
		r, ok := want[m.ID]
		if !ok {
			t.Errorf("message id %q is no event_id of this test", m.ID)
			continue
		}
		if held[m.ID]++; held[m.ID] > 1 {
			continue // a redelivery: order is judged on first deliveries
		}
		if r.seq <= last[r.aggregate] {
			t.Errorf("aggregate %s: first delivery of seq %d after seq %d", r.aggregate, r.seq, last[r.aggregate])
		}
		last[r.aggregate] = r.seq
	}
	again := 0
	for id := range want {
		switch {
		case held[id] == 0:
			t.Errorf("event %s is missing on the queue", id)
		case held[id] > 2:
			t.Errorf("event %s is held %d times, want at most twice (its publish before the alarm, and the relay's after)", id, held[id])
		case held[id] > 1:
			again++
		}
	}
	if again > maxAgain {
		t.Errorf("%d events held twice, want at most %d", again, maxAgain)
	}
	t.Logf("%d messages for %d events; %d events held twice or more (a publish that timed out in the alarm and was delivered once it cleared)",
		len(msgs), len(want), again)
}

// attemptSink is the sink as the relay sees it, recording the events that
// took more than the one attempt that published them. A published event
// keeps no attempts in the outbox (its delivery row is deleted), so the
// Event.Attempts that its successful publish carried tells: the attempts
// the relay had counted before.
type attemptSink struct {
	*Sink

	mu    sync.Mutex
	spent map[string]int // event_id: the earlier attempts a successful publish of it carried, when any
}

func newAttemptSink(s *Sink) *attemptSink {
	return &attemptSink{Sink: s, spent: map[string]int{}}
}

func (s *attemptSink) Publish(ctx context.Context, e outbox.Event) error {
	err := s.Sink.Publish(ctx, e)
	if err == nil && e.Attempts > 0 {
		s.mu.Lock()
		s.spent[e.EventID] = e.Attempts
		s.mu.Unlock()
	}
	return err
}

// count is the number of events published after spending attempts.
func (s *attemptSink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.spent)
}
