package nats

import (
	"testing"

	"worker/internal/outbox"
	"worker/internal/outbox/sinktest"
)

// BenchmarkDrain compares the NATS sink (in-process server) with the log
// sink in the same round (goal: at least 0.5 x).
//
//	go test -run '^$' -bench Drain -benchtime 2x ./internal/outbox/sink/nats
func BenchmarkDrain(b *testing.B) {
	sinktest.BenchDrain(b, "nats", func(tb testing.TB) outbox.Sink {
		tg, _ := newTarget(tb, false)
		tg.createStream(tb, 0)
		return connect(tb, tg.config())
	})
}
