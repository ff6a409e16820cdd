package rabbitmq

import (
	"testing"

	"worker/internal/outbox"
	"worker/internal/outbox/sinktest"
)

// BenchmarkDrain drains 100,000 events over 1,000 aggregates through the
// log sink and then through the RabbitMQ sink (the local broker, a durable
// queue bound to the exchange), in the same round, one relay with batches
// of 500, and reports both rates and their ratio (goal: at least 0.3).
//
//	go test -run '^$' -bench Drain -benchtime 2x ./internal/outbox/sink/rabbitmq
func BenchmarkDrain(b *testing.B) {
	const events, aggregates = 100_000, 1_000
	cfg := outbox.DefaultConfig()
	cfg.BatchSize = 500
	var logRate, rabbitRate float64
	for range b.N {
		logRate += sinktest.DrainRate(b, sinktest.LogSink(), cfg, events, aggregates)
		tg := newTarget(b, "#")
		rabbitRate += sinktest.DrainRate(b, connect(b, tg.config()), cfg, events, aggregates)
	}
	b.ReportMetric(logRate/float64(b.N), "log-events/s")
	b.ReportMetric(rabbitRate/float64(b.N), "rabbitmq-events/s")
	b.ReportMetric(rabbitRate/logRate, "rabbitmq/log")
}
