package rabbitmq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	rabbitmqbroker "github.com/worker-dev/worker/internal/broker/rabbitmq"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Child process settings of TestRelays.
const (
	childURLEnv      = "WORKER_SINKTEST_RABBITMQ_URL"
	childExchangeEnv = "WORKER_SINKTEST_RABBITMQ_EXCHANGE"
)

// requireBroker returns a connection to the test broker, or fails the
// test saying how to get one.
func requireBroker(t testing.TB) *amqp.Connection {
	t.Helper()
	testkit.SkipWithoutRabbitMQ(t)
	conn, err := amqp.Dial(testkit.RabbitMQURL())
	if err != nil {
		t.Fatalf("RabbitMQ is not reachable at %s: %v\nStart one (`rabbitmq-server -detached`; .ci/run does it), point %s at one, or set %s=1 to skip these tests.",
			broker.RedactURLs(testkit.RabbitMQURL()), err, testkit.RabbitMQURLEnv, testkit.RabbitMQSkipEnv)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// target is an exchange and a queue bound to it, for one test.
type target struct {
	url, exchange, queue string
}

// newTarget declares a topic exchange and a queue bound with binding.
func newTarget(t testing.TB, binding string) target {
	t.Helper()
	return declareTarget(t, requireBroker(t), testkit.RabbitMQURL(), binding)
}

// declareTarget declares the target on the broker at url, conn.
func declareTarget(t testing.TB, conn *amqp.Connection, url, binding string) target {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	id := uuid.NewString()[:8]
	tg := target{url: url, exchange: "sinktest-" + id, queue: "sinktest-" + id}
	if err := ch.ExchangeDeclare(tg.exchange, "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(tg.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(tg.queue, binding, tg.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if conn, err := amqp.Dial(tg.url); err == nil {
			ch, _ := conn.Channel()
			_, _ = ch.QueueDelete(tg.queue, false, false, false)
			_ = ch.ExchangeDelete(tg.exchange, false, false)
			_ = conn.Close()
		}
	})
	return tg
}

func (tg target) config() outboxconfig.RabbitMQConfig {
	c := outboxconfig.DefaultRabbitMQConfig()
	c.URL, c.Exchange = tg.url, tg.exchange
	c.ConnectTimeout = 10 * time.Second
	c.PublishTimeout = 2 * time.Second
	return c
}

func connect(t testing.TB, cfg outboxconfig.RabbitMQConfig) *Sink {
	t.Helper()
	s, err := New(cfg, Options{Name: "sinktest"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.ConnectTimeout)
	defer cancel()
	if err := s.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s
}

// read takes every message off the target's queue, in queue order, and
// checks the AMQP properties a consumer relies on.
func (tg target) read(t *testing.T) []sinktest.Message {
	t.Helper()
	conn, err := amqp.Dial(tg.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	var out []sinktest.Message
	for {
		d, ok, err := ch.Get(tg.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		m := sinktest.Message{ID: d.MessageId, Attrs: map[string]string{"datacontenttype": d.ContentType}, Headers: map[string]string{}, Body: d.Body}
		for k, v := range d.Headers {
			if name, ok := strings.CutPrefix(k, "cloudEvents:"); ok {
				m.Attrs[name] = fmt.Sprint(v)
			} else {
				m.Headers[k] = fmt.Sprint(v)
			}
		}
		if d.DeliveryMode != amqp.Persistent || d.Type != m.Attrs["type"] || d.AppId != "worker" || d.Timestamp.IsZero() {
			t.Errorf("message %s: delivery mode %d, type %q, app_id %q, timestamp %s", d.MessageId, d.DeliveryMode, d.Type, d.AppId, d.Timestamp)
		}
		out = append(out, m)
	}
}

func TestConformance(t *testing.T) {
	t.Parallel()
	tg := newTarget(t, "Sales%20Order.*")
	// Through a proxy the test can take the broker away from one sink.
	viaProxy := func(t *testing.T, publishTimeout time.Duration) (*Sink, *sinktest.Proxy) {
		u := testkit.ParseRabbitMQURL(t)
		p := sinktest.NewProxy(t, u.Host)
		u.Host = p.Addr()
		cfg := tg.config()
		cfg.URL = u.String()
		cfg.PublishTimeout = publishTimeout
		return connect(t, cfg), p
	}
	sinktest.Exercise(t, sinktest.Broker{
		New:  func(t *testing.T) outbox.Sink { return connect(t, tg.config()) },
		Read: tg.read,
		Refused: func(*testing.T) outbox.Event {
			e := sinktest.Event("nobody", 0)
			e.AggregateType = "Unbound" // no queue is bound for its routing key
			return e
		},
		Unreachable: func(t *testing.T, publishTimeout time.Duration) outbox.Sink {
			s, p := viaProxy(t, publishTimeout)
			p.Cut()
			return s
		},
		Silent: func(t *testing.T, publishTimeout time.Duration) outbox.Sink {
			s, p := viaProxy(t, publishTimeout)
			p.Freeze()
			return s
		},
		Secret: "guest:guest",
	})
}

// TestRelayProcess is the child relay process of TestRelays.
func TestRelayProcess(t *testing.T) {
	sinktest.RelayProcess(t, func(t *testing.T) outbox.Sink {
		return connect(t, target{url: os.Getenv(childURLEnv), exchange: os.Getenv(childExchangeEnv)}.config())
	})
}

// TestRelays: 3 relays in 2 processes publish 20,000 events over 200
// aggregates; the child is SIGKILLed mid-batch and the broker closes every
// connection mid-run (rabbitmqctl close_all_connections). Every event is in
// the queue, first deliveries in per-aggregate order.
//
// The test has a virtual host of its own, so that closing its connections
// leaves alone those of the tests running beside it on the same broker.
func TestRelays(t *testing.T) {
	t.Parallel()
	requireBroker(t)
	vhost, url := privateVHost(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	tg := declareTarget(t, conn, url, "#")
	sinktest.RelayRun(t, sinktest.Relays{
		Broker:     sinktest.Broker{New: func(t *testing.T) outbox.Sink { return connect(t, tg.config()) }, Read: tg.read},
		HelperTest: "TestRelayProcess",
		ChildEnv:   []string{childURLEnv + "=" + tg.url, childExchangeEnv + "=" + tg.exchange},
		Disrupt: func(t *testing.T) {
			rabbitmqctl(t, "close_all_connections", "--vhost", vhost, "closed by the sink test")
		},
	})
}

// privateVHost adds a virtual host that the test broker's user may use,
// deleted when t ends, and returns it with the broker URL that names it.
func privateVHost(t *testing.T) (vhost, url string) {
	t.Helper()
	u := testkit.ParseRabbitMQURL(t)
	vhost = "sinktest-" + uuid.NewString()[:8]
	rabbitmqctl(t, "add_vhost", vhost)
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "delete_vhost", vhost).Run() })
	rabbitmqctl(t, "set_permissions", "--vhost", vhost, cmp.Or(u.User.Username(), "guest"), ".*", ".*", ".*")
	u.Path = "/" + vhost
	return vhost, u.String()
}

func rabbitmqctl(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("rabbitmqctl", args...).CombinedOutput(); err != nil {
		t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func TestRoutingWord(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"Order":         "Order",
		"order.created": "order%2Ecreated",
		"a*b#c":         "a%2Ab%23c",
		"two words":     "two%20words",
		"50%":           "50%25",
		"":              "_",
	} {
		if got := rabbitmqbroker.RoutingWord(in); got != want {
			t.Errorf("RoutingWord(%q) = %q, want %q", in, got, want)
		}
	}
}

// On the default exchange the routing key names the queue: a template
// that lets an event choose it, or that can begin "amq.", is refused
// naming the key and the rule. On any other exchange the key only matches
// that exchange's bindings, and any template goes.
func TestDefaultExchangeQueueName(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		exchange, key string
		want          string // "" when accepted
	}{
		{"outbox", "{aggregate_type}.{event_type}", ""},
		{"amq.topic", "{aggregate_type}", ""},
		{"", "outbox.{aggregate_type}", ""},
		{"", "orders-{aggregate_type}", ""},
		{"", "billing", ""},
		{"", "amqueue.{aggregate_type}", ""},
		{"", "{aggregate_type}.{event_type}", `outbox.rabbitmq.routing_key="{aggregate_type}.{event_type}": with the default exchange (outbox.rabbitmq.exchange="") the routing key is a queue's name, so it must start with literal text`},
		{"", "{event_type}", "must start with literal text"},
		{"", "amq.rabbitmq.reply-to.{aggregate_id}", `outbox.rabbitmq.routing_key="amq.rabbitmq.reply-to.{aggregate_id}": with the default exchange (outbox.rabbitmq.exchange="") the routing key is a queue's name, and queue names starting with "amq." are the broker's`},
		{"", "amq.gen-x", `queue names starting with "amq." are the broker's`},
		{"", "a{aggregate_type}.rabbitmq.reply-to", `queue names starting with "amq." are the broker's`}, // {aggregate_type} = "mq"
	} {
		cfg := outboxconfig.DefaultRabbitMQConfig()
		cfg.Exchange, cfg.RoutingKey = c.exchange, c.key
		_, err := New(cfg, Options{})
		switch {
		case c.want == "" && err != nil:
			t.Errorf("exchange %q, key %q: %v", c.exchange, c.key, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("exchange %q, key %q: got %v, want an error with %q", c.exchange, c.key, err, c.want)
		}
	}
}

func TestConnect(t *testing.T) {
	t.Parallel()
	requireBroker(t)
	ctx := t.Context()
	t.Run("missing exchange names the key", func(t *testing.T) {
		cfg := outboxconfig.DefaultRabbitMQConfig()
		cfg.URL, cfg.Exchange = testkit.RabbitMQURL(), "sinktest-missing-"+uuid.NewString()[:8]
		s, err := New(cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		err = s.Connect(ctx)
		if !errors.Is(err, broker.ErrSetup) || !strings.Contains(err.Error(), "outbox.rabbitmq.exchange") {
			t.Errorf("got %v", err)
		}
	})
	t.Run("declare_exchange declares it", func(t *testing.T) {
		cfg := outboxconfig.DefaultRabbitMQConfig()
		cfg.URL, cfg.Exchange, cfg.DeclareExchange = testkit.RabbitMQURL(), "sinktest-declared-"+uuid.NewString()[:8], true
		s := connect(t, cfg)
		if err := s.Ready(ctx); err != nil {
			t.Errorf("ready: %v", err)
		}
		conn := requireBroker(t)
		ch, _ := conn.Channel()
		if err := ch.ExchangeDeclarePassive(cfg.Exchange, "topic", true, false, false, false, nil); err != nil {
			t.Errorf("exchange not declared: %v", err)
		}
		_ = ch.ExchangeDelete(cfg.Exchange, false, false)
	})
	t.Run("wrong password is refused at once", func(t *testing.T) {
		u := testkit.ParseRabbitMQURL(t)
		u.User = neturl.UserPassword(cmp.Or(u.User.Username(), "guest"), "wrong-secret-9")
		cfg := outboxconfig.DefaultRabbitMQConfig()
		cfg.URL = u.String()
		s, _ := New(cfg, Options{})
		err := s.Connect(ctx)
		if !errors.Is(err, broker.ErrRefused) || strings.Contains(err.Error(), "wrong-secret-9") {
			t.Errorf("got %v", err)
		}
	})
	t.Run("unreachable until the budget ends", func(t *testing.T) {
		cfg := outboxconfig.DefaultRabbitMQConfig()
		cfg.URL = "amqp://guest:hidden-7@127.0.0.1:1/"
		s, _ := New(cfg, Options{})
		cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		err := s.Connect(cctx)
		if !errors.Is(err, broker.ErrUnreachable) || strings.Contains(err.Error(), "hidden-7") {
			t.Errorf("got %v", err)
		}
	})
}
