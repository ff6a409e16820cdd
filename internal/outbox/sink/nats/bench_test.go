package nats

import (
	"fmt"
	"testing"

	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// BenchmarkPublish publishes b.N events through the sink from 256
// goroutines at once (the relay's default max_in_flight for a broker),
// each waiting for its ack, into a file-storage stream on an in-process
// server (or the one WORKER_TEST_NATS_URL names). It reports the
// process's CPU per message: the client's and, in process, the server's.
// The events carry a W3C traceparent, sampled or not: a sampled one makes
// the server parse every header of the message into a map, to look for a
// trace destination (see docs/brokers/nats.md, "Message").
//
//	go test -run '^$' -bench Publish -benchtime 100000x -benchmem ./internal/outbox/sink/nats
func BenchmarkPublish(b *testing.B) {
	for _, flags := range []struct{ name, value string }{{"sampled", "01"}, {"unsampled", "00"}} {
		b.Run(flags.name, func(b *testing.B) {
			tg, _ := newTarget(b, false)
			tg.createStream(b, 0)
			s := connect(b, tg.config())
			events := sinktest.Events(b.N)
			for i := range events {
				events[i].Headers["traceparent"] = fmt.Sprintf("00-%032x-%016x-%s", i+1, i+1, flags.value)
			}
			cpu := testkit.SelfCPU(b)
			b.ReportAllocs()
			sinktest.BenchPublish(b, s, events, 256)
			b.ReportMetric(float64((testkit.SelfCPU(b)-cpu).Microseconds())/float64(b.N), "cpu-µs/msg")
		})
	}
}
