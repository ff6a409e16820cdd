package kafka

import (
	"testing"

	"worker/internal/outbox"
	"worker/internal/outbox/sinktest"
)

// BenchmarkDrain compares the Kafka sink (an in-process kfake cluster of
// three brokers, 8 partitions) with the log sink in the same round.
//
//	go test -run '^$' -bench Drain -benchtime 2x ./internal/outbox/sink/kafka
func BenchmarkDrain(b *testing.B) {
	sinktest.BenchDrain(b, "kafka", func(tb testing.TB) outbox.Sink {
		return connect(tb, config(startCluster(tb, "Order").brokers(), "{aggregate_type}"))
	})
}
