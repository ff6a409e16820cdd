package outbox

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// The brokers of BenchmarkRelayScale's broker phases. Each phase gets a
// broker of its own: NATS and Kafka run in the benchmark process (so the
// benchmark process's CPU during the phase is the broker's), RabbitMQ is
// the real local broker with a queue of its own.

// benchBroker is a broker one phase publishes to.
type benchBroker struct {
	env   []string // APP_OUTBOX_* settings that point the worker at it
	local bool     // runs in this process: its CPU is this process's
	close func()
	// pid is the broker's process when it runs on this machine apart from
	// this one (0 otherwise), and pidCPU its CPU time when prepared.
	pid    int
	pidCPU time.Duration
}

// startBroker starts (or prepares) the broker of the named sink.
func startBroker(tb testing.TB, sink string) *benchBroker {
	tb.Helper()
	switch sink {
	case outboxconfig.SinkNATS:
		return startNATS(tb)
	case outboxconfig.SinkRabbitMQ:
		return prepareRabbitMQ(tb)
	case outboxconfig.SinkKafka:
		return startKafka(tb)
	}
	tb.Fatalf("no benchmark broker for sink %q", sink)
	return nil
}

// startNATS runs a nats-server with JetStream on file storage; the worker
// creates its stream.
func startNATS(tb testing.TB) *benchBroker {
	dir, err := os.MkdirTemp("", "bench-nats-")
	if err != nil {
		tb.Fatal(err)
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: dir, NoSigs: true, NoLog: true})
	if err != nil {
		tb.Fatal(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		tb.Fatal("nats-server did not start")
	}
	return &benchBroker{
		env:   []string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_URL=" + srv.ClientURL(), "APP_OUTBOX_NATS_CREATE_STREAM=true"},
		local: true,
		close: func() {
			srv.Shutdown()
			srv.WaitForShutdown()
			_ = os.RemoveAll(dir)
		},
	}
}

// startKafka runs a kfake cluster of three brokers that keeps its data in
// files, with the topic the worker's default template names for the
// backlog ("order") in 8 partitions.
func startKafka(tb testing.TB) *benchBroker {
	dir, err := os.MkdirTemp("", "bench-kafka-")
	if err != nil {
		tb.Fatal(err)
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.DataDir(dir), kfake.SeedTopics(8, "order"))
	if err != nil {
		tb.Fatal(err)
	}
	return &benchBroker{
		env:   []string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_BROKERS=" + strings.Join(c.ListenAddrs(), ",")},
		local: true,
		close: func() {
			c.Close()
			_ = os.RemoveAll(dir)
		},
	}
}

// rabbitQueueArgs are the arguments of the benchmark's queue, as
// docs/brokers/rabbitmq.md recommends for an outbox's queues: a lazy classic queue
// writes each message to disk at once instead of also keeping it in the
// queue process, and version 2 is the newer message store. Together they
// took the broker about half the CPU per persistent message of the default
// on RabbitMQ 3.10, and the default's grows as a queue nobody consumes
// grows to the whole backlog. From 3.12 on, classic queues are lazy anyway
// and from 3.13 on version 2 by default.
var rabbitQueueArgs = amqp.Table{"x-queue-mode": "lazy", "x-queue-version": 2}

// prepareRabbitMQ declares a durable topic exchange and a durable queue
// bound to it with "#" on the local RabbitMQ, so that every persistent
// message is routed and stored; both are deleted afterwards. When the
// broker runs on this machine, its process is found by its listening
// port, so the phase can report its CPU.
func prepareRabbitMQ(tb testing.TB) *benchBroker {
	url := testkit.RabbitMQURL()
	uri, err := amqp.ParseURI(url)
	if err != nil {
		tb.Fatalf("%s: %v", testkit.RabbitMQURLEnv, err)
	}
	name := "bench-" + uuid.NewString()[:8]
	admin := func(f func(*amqp.Channel) error) {
		conn, err := amqp.Dial(url)
		if err != nil {
			tb.Fatalf("RabbitMQ is not reachable (%s names another): %v", testkit.RabbitMQURLEnv, err)
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err == nil {
			err = f(ch)
		}
		if err != nil {
			tb.Fatalf("rabbitmq: %v", err)
		}
	}
	admin(func(ch *amqp.Channel) error {
		if err := ch.ExchangeDeclare(name, "topic", true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(name, true, false, false, false, rabbitQueueArgs); err != nil {
			return err
		}
		return ch.QueueBind(name, "#", name, false, nil)
	})
	pid := testkit.ListenerPID(uri.Port)
	pidCPU, err := testkit.ProcessCPU(pid)
	if err != nil {
		pid = 0 // not readable: no broker CPU
	}
	return &benchBroker{
		env:    []string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_URL=" + url, "APP_OUTBOX_RABBITMQ_EXCHANGE=" + name},
		pid:    pid,
		pidCPU: pidCPU,
		close: func() {
			admin(func(ch *amqp.Channel) error {
				if _, err := ch.QueueDelete(name, false, false, false); err != nil {
					return err
				}
				return ch.ExchangeDelete(name, false, false)
			})
		},
	}
}

// brokerCPU is the CPU the phase's broker used while the worker ran, when
// it runs in this process or its process on this machine is known; 0
// otherwise. A broker process of its own counts whatever else used it
// meanwhile too.
func brokerCPU(tb testing.TB, b *benchBroker, since time.Duration) time.Duration {
	switch {
	case b == nil:
		return 0
	case b.local:
		return testkit.SelfCPU(tb) - since
	case b.pid != 0:
		if cpu, err := testkit.ProcessCPU(b.pid); err == nil {
			return cpu - b.pidCPU
		}
	}
	return 0
}

// brokerSetup describes the brokers for the printed table.
func brokerSetup() string {
	rabbit := "the local broker"
	if os.Getenv(testkit.RabbitMQURLEnv) != "" {
		rabbit = "the broker " + testkit.RabbitMQURLEnv + " names"
	}
	return "NATS: nats-server in this process (file storage); RabbitMQ: " + rabbit +
		" (durable lazy classic queue of version 2, persistent messages; its CPU when it runs on this machine); Kafka: kfake in this process (3 brokers, 8 partitions, data in files)"
}
