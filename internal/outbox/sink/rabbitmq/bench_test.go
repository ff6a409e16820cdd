package rabbitmq

import (
	"testing"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// BenchmarkPublish publishes b.N events through the sink from 64
// goroutines at once, each waiting for its confirm, into a durable queue
// that nothing consumes: a classic queue in its default mode, lazy, and
// lazy of version 2, and a stream (see docs/brokers/rabbitmq.md, "Queues"). It
// reports the client's CPU per message and, when the broker's process runs
// on this machine, the broker's (whatever else uses the broker meanwhile
// counts too: give it a node of its own with WORKER_TEST_RABBITMQ_URL).
//
//	go test -run '^$' -bench Publish -benchtime 30000x ./internal/outbox/sink/rabbitmq
func BenchmarkPublish(b *testing.B) {
	for _, q := range []struct {
		name string
		args amqp.Table
	}{
		{"default", amqp.Table{"x-queue-mode": "default"}},
		{"lazy", amqp.Table{"x-queue-mode": "lazy"}},
		{"lazy-v2", amqp.Table{"x-queue-mode": "lazy", "x-queue-version": 2}},
		{"stream", amqp.Table{"x-queue-type": "stream"}},
	} {
		b.Run(q.name, func(b *testing.B) {
			conn := requireBroker(b)
			tg := declareQueue(b, conn, q.args)
			s := connect(b, tg.config())
			uri, err := amqp.ParseURI(tg.url)
			if err != nil {
				b.Fatal(err)
			}
			broker := testkit.ListenerPID(uri.Port)
			events := sinktest.Events(b.N)
			brokerCPU, _ := testkit.ProcessCPU(broker) // 0 when it cannot be read
			clientCPU := testkit.SelfCPU(b)
			sinktest.BenchPublish(b, s, events, 64)
			n := float64(b.N)
			b.ReportMetric(float64((testkit.SelfCPU(b)-clientCPU).Microseconds())/n, "client-µs/msg")
			if cpu, err := testkit.ProcessCPU(broker); broker != 0 && err == nil {
				b.ReportMetric(float64((cpu-brokerCPU).Microseconds())/n, "broker-µs/msg")
			}
		})
	}
}

// declareQueue declares a topic exchange and a durable queue with args,
// bound with "#", both deleted when tb ends.
func declareQueue(tb testing.TB, conn *amqp.Connection, args amqp.Table) target {
	tb.Helper()
	ch, err := conn.Channel()
	if err != nil {
		tb.Fatal(err)
	}
	name := "sinkbench-" + uuid.NewString()[:8]
	tg := target{url: testkit.RabbitMQURL(), exchange: name, queue: name}
	if err := ch.ExchangeDeclare(name, "topic", true, false, false, false, nil); err != nil {
		tb.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		tb.Fatal(err)
	}
	if err := ch.QueueBind(name, "#", name, false, nil); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_, _ = ch.QueueDelete(name, false, false, false)
		_ = ch.ExchangeDelete(name, false, false)
	})
	return tg
}
