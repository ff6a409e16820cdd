package nats

import (
	"testing"

	"worker/internal/outbox"
	"worker/internal/outbox/sinktest"
)

// BenchmarkDrain drains 100,000 events over 1,000 aggregates through the
// log sink and then through the NATS sink (in-process server), in the same
// round, one relay with batches of 500, and reports both rates and their
// ratio (goal: NATS at least 0.5 x the log sink).
//
//	go test -run '^$' -bench Drain -benchtime 3x ./internal/outbox/sink/nats
func BenchmarkDrain(b *testing.B) {
	const events, aggregates = 100_000, 1_000
	cfg := outbox.DefaultConfig()
	cfg.BatchSize = 500
	var logRate, natsRate float64
	for range b.N {
		logRate += sinktest.DrainRate(b, sinktest.LogSink(), cfg, events, aggregates)
		tg, _ := newTarget(b, false)
		tg.createStream(b, 0)
		natsRate += sinktest.DrainRate(b, connect(b, tg.config()), cfg, events, aggregates)
	}
	b.ReportMetric(logRate/float64(b.N), "log-events/s")
	b.ReportMetric(natsRate/float64(b.N), "nats-events/s")
	b.ReportMetric(natsRate/logRate, "nats/log")
}
