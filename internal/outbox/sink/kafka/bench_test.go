package kafka

import (
	"testing"

	"worker/internal/outbox"
	"worker/internal/outbox/sinktest"
)

// BenchmarkDrain drains 100,000 events over 1,000 aggregates through the
// log sink and then through the Kafka sink (an in-process kfake cluster of
// three brokers, 8 partitions), in the same round, one relay with batches
// of 500, and reports both rates and their ratio.
//
//	go test -run '^$' -bench Drain -benchtime 2x ./internal/outbox/sink/kafka
func BenchmarkDrain(b *testing.B) {
	const events, aggregates = 100_000, 1_000
	cfg := outbox.DefaultConfig()
	cfg.BatchSize = 500
	var logRate, kafkaRate float64
	for range b.N {
		logRate += sinktest.DrainRate(b, sinktest.LogSink(), cfg, events, aggregates)
		cl := startCluster(b, "Order")
		kafkaRate += sinktest.DrainRate(b, connect(b, config(cl.brokers(), "{aggregate_type}")), cfg, events, aggregates)
	}
	b.ReportMetric(logRate/float64(b.N), "log-events/s")
	b.ReportMetric(kafkaRate/float64(b.N), "kafka-events/s")
	b.ReportMetric(kafkaRate/logRate, "kafka/log")
}
