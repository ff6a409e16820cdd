package rabbitmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	rmqsink "github.com/worker-dev/worker/internal/outbox/sink/rabbitmq"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Events our own rabbitmq sink publishes are each processed once, in
// their aggregate's order, and acknowledged: the queue is empty once the
// source has stopped.
func TestOutboxEventsProcessedOnceInOrder(t *testing.T) {
	t.Parallel()
	queue := newQueue(t)
	f := newFixture(t, nil)

	cfg := outboxconfig.DefaultRabbitMQConfig()
	cfg.URL, cfg.Exchange, cfg.RoutingKey = testkit.RabbitMQURL(), "", queue
	s, err := rmqsink.New(cfg, rmqsink.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	const n, aggregates = 300, 5
	for i := range n {
		e := outbox.Event{
			Seq: int64(i), EventID: uuid.NewString(), AggregateType: "order", AggregateID: fmt.Sprintf("order-%d", i%aggregates),
			EventType: "order.updated", Payload: json.RawMessage(fmt.Sprintf(`{"seq": %d}`, i)), OccurredAt: time.Now(),
		}
		if err := s.Publish(ctx, e); err != nil {
			t.Fatal(err)
		}
	}

	w := &watch{t: t, f: f}
	src := newSource(t, queue, "")
	stop := runUntil(t, src, w)
	testkit.Eventually(t, time.Minute, "every event processed", func() bool {
		return f.count(t, `SELECT count(*) FROM work`) == n
	})
	stop()
	if got := f.count(t, `SELECT count(DISTINCT msg_id) FROM work`); got != n {
		t.Errorf("%d distinct events did work, want %d", got, n)
	}
	if got := f.count(t, `SELECT count(*) FROM work WHERE msg_source <> 'order' OR order_key NOT LIKE 'order/order-%'`); got != 0 {
		t.Errorf("%d rows with another source or order key", got)
	}
	// seq follows publication; within an aggregate, work must follow it.
	if got := f.count(t, `SELECT count(*) FROM (
		SELECT seq < lag(seq) OVER (PARTITION BY order_key ORDER BY n) AS back FROM work) x WHERE back`); got != 0 {
		t.Errorf("%d events did their work before an earlier event of their aggregate", got)
	}
	// Every message was acknowledged, or comes again as a duplicate: a
	// quorum queue may drop acks sent just before the connection closes
	// (rabbitmq-server#10327). A second run takes what came back.
	run(t, newSource(t, queue, ""), &watch{t: t, f: f})
	testkit.Eventually(t, 30*time.Second, "the queue to be empty", func() bool { return readyCount(t, queue) == 0 })
	if got := f.count(t, `SELECT count(*) FROM work`); got != n {
		t.Errorf("%d pieces of work for %d events after a second run", got, n)
	}
	if got := f.received(t, inbox.Processed); got != n {
		t.Errorf("inbox_received_total{processed} = %d, want %d", got, n)
	}
}

// A message delivered again, whether published twice or redelivered after
// the consumer lost its channel before the ack, is a duplicate: its work
// happens once.
func TestRedeliveryIsDuplicate(t *testing.T) {
	t.Parallel()
	queue := newQueue(t)
	f := newFixture(t, nil)
	u := testkit.ParseRabbitMQURL(t)
	proxy := sinktest.NewProxy(t, u.Host)

	// The first delivery of "lost" has its work committed, then the
	// connection goes before the ack: the broker delivers it again.
	var once sync.Once
	cut := make(chan struct{})
	w := &watch{t: t, f: f, before: func(d *inbox.Delivery, settle func(context.Context, inbox.Outcome, time.Duration) error) func(context.Context, inbox.Outcome, time.Duration) error {
		return func(ctx context.Context, o inbox.Outcome, after time.Duration) error {
			if d.Message.ID == "lost" && o == inbox.Processed {
				once.Do(func() { proxy.Cut(); close(cut) })
			}
			return settle(ctx, o, after)
		}
	}}
	run(t, newSource(t, queue, proxy.Addr()), w)
	p := newPublisher(t)
	p.publish(queue, event("twice", "order", "a", 1), event("twice", "order", "a", 1))
	testkit.Eventually(t, 30*time.Second, "the second copy to be a duplicate", func() bool { return f.received(t, inbox.Duplicate) == 1 })

	p.publish(queue, event("lost", "order", "b", 2))
	<-cut
	proxy.Restore(t)
	testkit.Eventually(t, 30*time.Second, "the redelivery to be a duplicate", func() bool { return f.received(t, inbox.Duplicate) == 2 })
	if got := f.count(t, `SELECT count(*) FROM work`); got != 2 {
		t.Errorf("%d pieces of work for 2 messages", got)
	}
	testkit.Eventually(t, 10*time.Second, "the queue to be empty", func() bool { return readyCount(t, queue) == 0 })
}

// A message with neither a CloudEvents id nor a message_id is dead-lettered
// under its body's digest, does no work, and is acknowledged.
func TestUnkeyedMessageIsDead(t *testing.T) {
	t.Parallel()
	queue := newQueue(t)
	f := newFixture(t, nil)
	w := &watch{t: t, f: f}
	stop := runUntil(t, newSource(t, queue, ""), w)
	newPublisher(t).publish(queue, amqp.Publishing{Body: []byte(`{"seq": 1}`), Headers: amqp.Table{"x-note": "foreign"}})
	testkit.Eventually(t, 30*time.Second, "the message to be dead-lettered", func() bool { return f.received(t, inbox.Dead) == 1 })
	stop()
	var src, reason string
	if err := f.db.Pool.QueryRow(context.Background(),
		`SELECT msg_source, last_error FROM inbox_message WHERE state = 'DEAD'`).Scan(&src, &reason); err != nil {
		t.Fatal(err)
	}
	if src != "!unkeyed" || !strings.Contains(reason, "no dedupe key") {
		t.Errorf("dead letter under %q, reason %q", src, reason)
	}
	if got := f.count(t, `SELECT count(*) FROM work`); got != 0 {
		t.Errorf("%d pieces of work for a message without a key", got)
	}
	if got := readyCount(t, queue); got != 0 {
		t.Errorf("the dead message is back in the queue: it was not acknowledged")
	}
}

// While a message's work has not committed, its delivery is held
// unacknowledged: when the connection goes meanwhile, the broker puts the
// message back in the queue. The work then commits (its ack is lost with
// the connection), and the redelivery is a duplicate: one piece of work.
func TestAckOnlyAfterCommit(t *testing.T) {
	t.Parallel()
	queue := newQueue(t)
	entered, release := make(chan struct{}, 1), make(chan struct{})
	f := newFixture(t, inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return inbox.SQLHandler{SQL: workSQL}.Handle(ctx, tx, m)
	}))
	proxy := sinktest.NewProxy(t, testkit.ParseRabbitMQURL(t).Host)
	w := &watch{t: t, f: f}
	run(t, newSource(t, queue, proxy.Addr()), w)
	newPublisher(t).publish(queue, event("held", "order", "a", 1))
	<-entered
	if got := readyCount(t, queue); got != 0 {
		t.Fatalf("%d messages ready while the only one is being worked on", got)
	}
	// Its claim commits with its work: nothing is visible before.
	if rows, acked := f.count(t, `SELECT count(*) FROM inbox_message WHERE msg_id = 'held'`), w.settled(); rows != 0 || len(acked) != 0 {
		t.Fatalf("%d rows committed, settled %v while the work has not committed", rows, acked)
	}
	proxy.Cut()
	testkit.Eventually(t, 10*time.Second, "the unacknowledged message to be back in the queue", func() bool { return readyCount(t, queue) == 1 })

	close(release)
	testkit.Eventually(t, 10*time.Second, "the work to commit", func() bool { return f.count(t, `SELECT count(*) FROM work`) == 1 })
	proxy.Restore(t)
	testkit.Eventually(t, 30*time.Second, "the redelivery to be a duplicate", func() bool { return f.received(t, inbox.Duplicate) == 1 })
	testkit.Eventually(t, 10*time.Second, "the queue to be empty", func() bool { return readyCount(t, queue) == 0 })
	if got := f.count(t, `SELECT count(*) FROM work`); got != 1 {
		t.Errorf("%d pieces of work for one message", got)
	}
}

// A connection the broker side closes mid-stream is an outage: Down, then
// Up once consuming again; every message is processed once, in its
// aggregate's order, and no attempt is spent.
func TestConnectionKilled(t *testing.T) {
	t.Parallel()
	queue := newQueue(t)
	f := newFixture(t, nil)
	proxy := sinktest.NewProxy(t, testkit.ParseRabbitMQURL(t).Host)
	w := &watch{t: t, f: f}
	run(t, newSource(t, queue, proxy.Addr()), w)
	testkit.Eventually(t, 10*time.Second, "the source to be up", func() bool { return slices.Contains(w.seen(), "up") })

	const n = 400
	msgs := make([]amqp.Publishing, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("m-%03d", i), "order", "one", i)
	}
	newPublisher(t).publish(queue, msgs...)
	testkit.Eventually(t, 30*time.Second, "some work done", func() bool { return f.count(t, `SELECT count(*) FROM work`) >= 50 })
	proxy.Cut()
	testkit.Eventually(t, 10*time.Second, "the source to report the loss", func() bool { return slices.Contains(w.seen(), "down") })
	proxy.Restore(t)
	testkit.Eventually(t, time.Minute, "every message processed", func() bool { return f.count(t, `SELECT count(*) FROM work`) >= n })

	// A failed redial reports down again; the consumer logs an outage once.
	if got := slices.Compact(w.seen()); len(got) < 3 || !slices.Equal(got[:3], []string{"up", "down", "up"}) {
		t.Errorf("reports %v, want up, down, up first", w.seen())
	}
	if got := f.count(t, `SELECT count(DISTINCT msg_id) FROM work`); got != n {
		t.Errorf("%d distinct messages did work, want %d", got, n)
	}
	if got := f.count(t, `SELECT count(*) FROM work`); got != n {
		t.Errorf("%d pieces of work for %d messages", got, n)
	}
	if got := f.count(t, `SELECT coalesce(max(attempts), 0) FROM inbox_message`); got != 0 {
		t.Errorf("an attempt was spent on the outage: max attempts %d", got)
	}
	if got := f.count(t, `SELECT count(*) FROM (SELECT seq < lag(seq) OVER (ORDER BY n) AS back FROM work) x WHERE back`); got != 0 {
		t.Errorf("%d messages did their work before an earlier one of their aggregate", got)
	}
	if got := f.received(t, inbox.Failed) + f.received(t, inbox.Dead); got != 0 {
		t.Errorf("%d messages failed or died of the outage", got)
	}
}

// Bad setup is returned from Run, not retried: refused credentials, a
// missing queue, a queue declared otherwise.
func TestSetupErrors(t *testing.T) {
	t.Parallel()
	t.Run("credentials", func(t *testing.T) {
		t.Parallel()
		src := newSource(t, "inboxtest-none", "", func(c *inboxconfig.RabbitMQSource) { c.URL = withUser(t, "guest", "wrong-password") })
		err := runErr(t, src, 20*time.Second)
		if !errors.Is(err, broker.ErrRefused) {
			t.Errorf("err = %v, want ErrRefused", err)
		}
		if err != nil && strings.Contains(err.Error(), "wrong-password") {
			t.Errorf("the error shows the password: %v", err)
		}
	})
	t.Run("missing queue", func(t *testing.T) {
		t.Parallel()
		requireBroker(t)
		src := newSource(t, "inboxtest-missing-"+uuid.NewString()[:8], "", func(c *inboxconfig.RabbitMQSource) { c.DeclareQueue = false })
		if err := runErr(t, src, 20*time.Second); !errors.Is(err, broker.ErrSetup) {
			t.Errorf("err = %v, want ErrSetup", err)
		}
	})
	t.Run("queue declared otherwise", func(t *testing.T) {
		t.Parallel()
		ch, err := requireBroker(t).Channel()
		if err != nil {
			t.Fatal(err)
		}
		name := "inboxtest-classic-" + uuid.NewString()[:8]
		if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = ch.QueueDelete(name, false, false, false) })
		if err := runErr(t, newSource(t, name, ""), 20*time.Second); !errors.Is(err, broker.ErrSetup) {
			t.Errorf("err = %v, want ErrSetup", err)
		}
	})
}

// The mapping of a delivery to a message.
func TestMessage(t *testing.T) {
	t.Parallel()
	d := &amqp.Delivery{
		MessageId: "m1", RoutingKey: "order.updated", Type: "amqp-type", Body: []byte("{}"),
		Headers: amqp.Table{"cloudEvents:id": "e1", "cloudEvents:source": "order", "cloudEvents:type": "order.updated",
			"cloudEvents:subject": "o-7", "traceparent": "00-x", "n": int32(7), "message_id": "spoof"},
	}
	m := message(d, "q")
	want := inbox.Message{ID: "e1", Source: "order", Type: "order.updated", OrderKey: "order/o-7", Origin: "q"}
	if m.ID != want.ID || m.Source != want.Source || m.Type != want.Type || m.OrderKey != want.OrderKey || m.Origin != want.Origin {
		t.Errorf("message = %+v", m)
	}
	if m.Headers["message_id"] != "m1" || m.Headers["routing_key"] != "order.updated" || m.Headers["n"] != "7" || m.Headers["traceparent"] != "00-x" {
		t.Errorf("headers = %v", m.Headers)
	}
	foreign := message(&amqp.Delivery{MessageId: "m2", Type: "t"}, "q")
	// message_id is the NativeID, the key unless the source configures one.
	if foreign.ID != "" || foreign.Headers["message_id"] != "m2" || foreign.Source != "" || foreign.OrderKey != "" || foreign.Type != "t" {
		t.Errorf("foreign message = %+v", foreign)
	}
	if none := message(&amqp.Delivery{Body: []byte("x")}, "q"); none.ID != "" {
		t.Errorf("a message without id got ID %q", none.ID)
	}
}
