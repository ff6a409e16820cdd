package rabbitmq

import (
	"testing"

	"worker/internal/outbox"
	"worker/internal/outbox/sinktest"
)

// BenchmarkDrain compares the RabbitMQ sink (the local broker, a durable
// queue bound to the exchange) with the log sink in the same round (goal:
// at least 0.3 x).
//
//	go test -run '^$' -bench Drain -benchtime 2x ./internal/outbox/sink/rabbitmq
func BenchmarkDrain(b *testing.B) {
	sinktest.BenchDrain(b, "rabbitmq", func(tb testing.TB) outbox.Sink {
		return connect(tb, newTarget(tb, "#").config())
	})
}
