package rabbitmq

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// requireBroker returns a connection to the test broker, or fails the
// test saying how to get one: these tests never skip.
func requireBroker(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.Dial(testkit.RabbitMQURL())
	if err != nil {
		t.Fatalf("RabbitMQ is not reachable at %s: %v\nStart one (`rabbitmq-server -detached`; .ci/run does it), or point %s at one.",
			broker.RedactURLs(testkit.RabbitMQURL()), err, testkit.RabbitMQURLEnv)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// newQueue declares a queue of its own for t, as declare_queue would, and
// deletes it when t ends.
func newQueue(t testing.TB) string {
	t.Helper()
	name := "inboxtest-" + uuid.NewString()[:8]
	declareQueue(t, name)
	return name
}

// declareQueue declares queue name as declare_queue would, and deletes it
// when t ends.
func declareQueue(t testing.TB, name string) {
	t.Helper()
	ch, err := requireBroker(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, queueArgs()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn, err := amqp.Dial(testkit.RabbitMQURL())
		if err != nil {
			t.Errorf("delete queue %s: %v", name, err)
			return
		}
		defer conn.Close()
		if ch, err := conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(name, false, false, false)
		}
	})
}

// publisher publishes to the default exchange in confirm mode.
type publisher struct {
	t  testing.TB
	ch *amqp.Channel
}

func newPublisher(t testing.TB) *publisher {
	t.Helper()
	ch, err := requireBroker(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	return &publisher{t: t, ch: ch}
}

// publish sends msgs to queue and waits for the broker's confirms.
func (p *publisher) publish(queue string, msgs ...amqp.Publishing) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var confirms []*amqp.DeferredConfirmation
	for _, m := range msgs {
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, m)
		if err != nil {
			p.t.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	for _, dc := range confirms {
		if ok, err := dc.WaitContext(ctx); err != nil || !ok {
			p.t.Fatalf("publish not confirmed: %v", err)
		}
	}
}

// event is a message as the outbox's rabbitmq sink sends it.
func event(id, source, subject string, seq int) amqp.Publishing {
	return amqp.Publishing{
		MessageId:    id,
		DeliveryMode: amqp.Persistent,
		ContentType:  "application/json",
		Type:         "order.updated",
		Headers: amqp.Table{
			"cloudEvents:specversion": "1.0",
			"cloudEvents:id":          id,
			"cloudEvents:source":      source,
			"cloudEvents:type":        "order.updated",
			"cloudEvents:subject":     subject,
		},
		Body: fmt.Appendf(nil, `{"seq": %d}`, seq),
	}
}

// readyCount is the number of messages ready in queue: delivered ones
// that wait for their ack do not count.
func readyCount(t testing.TB, queue string) int {
	t.Helper()
	ch, err := requireBroker(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, queueArgs())
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// workSQL is the sql handler of the tests: one row of work per message.
const workSQL = `INSERT INTO work (msg_source, msg_id, order_key, seq)
VALUES (@source, @id, @order_key, (@body_json::jsonb ->> 'seq')::int)`

// fixture is one test's inbox: a database with a work table, and the
// consumer of source "rmq" with the sql handler.
type fixture struct {
	db  *pgtest.DB
	reg *prometheus.Registry
	c   *inbox.Consumer
}

func newFixture(t testing.TB, handler inbox.Handler) *fixture {
	t.Helper()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE work (
		n bigserial PRIMARY KEY, msg_source text, msg_id text, order_key text, seq int)`); err != nil {
		t.Fatal(err)
	}
	if handler == nil {
		handler = inbox.SQLHandler{SQL: workSQL}
	}
	reg := prometheus.NewRegistry()
	cfg := inboxconfig.DefaultConfig()
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 100*time.Millisecond
	src := inboxconfig.SourceConfig{Name: "rmq", Kind: inboxconfig.KindRabbitMQ, Handler: inboxconfig.HandlerConfig{Kind: inboxconfig.HandlerSQL, SQL: workSQL}}
	c := inboxtest.NewConsumer(t, db.Pool, src, cfg, handler, reg)
	return &fixture{db: db, reg: reg, c: c}
}

// count runs a query returning one number.
func (f *fixture) count(t testing.TB, q string, args ...any) int {
	t.Helper()
	return inboxtest.Scalar(t, f.db.Pool, q, args...)
}

// received reads inbox_received_total for outcome.
func (f *fixture) received(t testing.TB, o inbox.Outcome) int {
	t.Helper()
	v, _ := testkit.Metric(t, f.reg, "inbox_received_total", map[string]string{"source": "rmq", "outcome": string(o)})
	return int(v)
}

// watch is the consumer as the source sees it, recording Up and Down, and
// checking that every acknowledgement follows the commit it reports.
type watch struct {
	t testing.TB
	f *fixture
	// before, if set, replaces a delivery's settle, which it may call.
	before func(d *inbox.Delivery, settle func(context.Context, inbox.Outcome, time.Duration) error) func(context.Context, inbox.Outcome, time.Duration) error

	mu     sync.Mutex
	events []string // "up" and "down", in order
	acked  []string
}

func (w *watch) Up() {
	w.mu.Lock()
	w.events = append(w.events, "up")
	w.mu.Unlock()
	w.f.c.Up()
}

func (w *watch) Down(err error) {
	w.mu.Lock()
	w.events = append(w.events, "down")
	w.mu.Unlock()
	w.f.c.Down(err)
}

func (w *watch) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		settle := d.Settle
		checked := func(ctx context.Context, o inbox.Outcome, after time.Duration) error {
			if o == inbox.Processed || o == inbox.Duplicate {
				// d.Message carries the key the consumer applied.
				var state string
				err := w.f.db.Pool.QueryRow(ctx, `SELECT state FROM inbox_message WHERE consumer = 'rmq' AND msg_source = $1 AND msg_id = $2`,
					d.Message.Source, d.Message.ID).Scan(&state)
				if err != nil || (state != "PROCESSED" && state != "DEAD") {
					w.t.Errorf("%s settled %s before its commit: state %q, %v", d.Message.ID, o, state, err)
				}
			}
			if o != inbox.Busy {
				w.mu.Lock()
				w.acked = append(w.acked, d.Message.ID)
				w.mu.Unlock()
			}
			return settle(ctx, o, after)
		}
		d.Settle = checked
		if w.before != nil {
			d.Settle = w.before(d, checked)
		}
	}
	w.f.c.Process(ctx, batch)
}

func (w *watch) settled() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.acked...)
}

func (w *watch) seen() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.events...)
}

// run runs src until t ends, and checks that it then returns nil.
func run(t testing.TB, src *Source, h inbox.Handoff) { runUntil(t, src, h) }

// runUntil runs src and returns a function that stops it; it also stops
// when t ends, and then checks that Run returned nil.
func runUntil(t testing.TB, src *Source, h inbox.Handoff) (stop func()) {
	t.Helper()
	stopRun := inboxtest.RunSource(t, src, h)
	return func() { _ = stopRun() }
}

// newSource is a source on queue through the broker at host (the test
// broker's when empty).
func newSource(t testing.TB, queue, host string, tweak ...func(*inboxconfig.RabbitMQSource)) *Source {
	t.Helper()
	u := testkit.ParseRabbitMQURL(t)
	if host != "" {
		u.Host = host
	}
	cfg := inboxconfig.DefaultSource().RabbitMQ
	cfg.URL, cfg.Queue, cfg.DeclareQueue, cfg.ConnectTimeout = u.String(), queue, true, 5*time.Second
	for _, f := range tweak {
		f(&cfg)
	}
	s, err := New(cfg, Options{Name: "rmq", ProbeBackoffMax: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// nullHandoff takes nothing: for setup errors, raised before any batch.
type nullHandoff struct{}

func (nullHandoff) Process(context.Context, []*inbox.Delivery) {}
func (nullHandoff) Up()                                        {}
func (nullHandoff) Down(error)                                 {}

// runErr runs src until it returns or within passes.
func runErr(t testing.TB, src *Source, within time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	err := src.Run(ctx, nullHandoff{})
	if err == nil && ctx.Err() != nil {
		t.Fatalf("Run kept retrying for %s; want the setup error", within)
	}
	return err
}

// withUser is the test broker's URL with other credentials.
func withUser(t testing.TB, user, pass string) string {
	u := testkit.ParseRabbitMQURL(t)
	u.User = url.UserPassword(user, pass)
	return u.String()
}
