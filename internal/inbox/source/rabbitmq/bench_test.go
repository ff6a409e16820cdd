package rabbitmq

import (
	"flag"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
	"github.com/worker-dev/worker/internal/testkit"
)

var (
	benchRounds   = flag.Int("rounds", 3, "BenchmarkInboxRabbitMQ: rounds (the phase order alternates between rounds)")
	benchMessages = flag.Int("messages", 20000, "BenchmarkInboxRabbitMQ: messages per phase")
	benchBatch    = flag.Int("batch", 100, "BenchmarkInboxRabbitMQ: inbox.batch_size")
	benchPrefetch = flag.Int("prefetch", inboxconfig.DefaultSource().RabbitMQ.Prefetch, "BenchmarkInboxRabbitMQ: the source's prefetch")
)

// BenchmarkInboxRabbitMQ drains the same messages (over 1,000 aggregates)
// from the local broker in three phases per round, each from a quorum
// queue of its own holding the round's copy, the source in front of: a
// bare handoff that acks every message at once (the source's own
// consume-and-ack loop); the sql handler's statement run for the batch in
// one transaction, then acked (the work without the inbox's bookkeeping);
// the inbox with the sql handler. A queue per phase also keeps apart the
// messages a quorum queue hands back when acks sent just before a
// connection closed are dropped (rabbitmq-server#10327). It prints the
// rates per round and the inbox's ratio to the bare loop and to the plain
// work, min / median / max over -rounds.
//
//	go test -run '^$' -bench InboxRabbitMQ -benchtime 1x ./internal/inbox/source/rabbitmq -rounds 5
func BenchmarkInboxRabbitMQ(b *testing.B) {
	f := inboxtest.NewFixture(b, inboxconfig.KindRabbitMQ)
	f.Cfg.BatchSize = *benchBatch
	f.Src.RabbitMQ.URL = testkit.ParseRabbitMQURL(b).String()
	f.Src.RabbitMQ.Prefetch, f.Src.RabbitMQ.ConnectTimeout = *benchPrefetch, 5*time.Second
	prefix := "inboxbench-" + uuid.NewString()[:8] + "-"
	pub := newPublisher(b)
	bench := &inboxtest.Bench{
		Fixture: f, Kind: "rabbitmq", Loop: "consume-and-ack", Rounds: *benchRounds, Messages: *benchMessages,
		Load: func(round int, readers []string) string {
			msgs := backlog(fmt.Sprintf("r%d", round), *benchMessages)
			for _, r := range readers {
				declareQueue(b, prefix+r)
				pub.publish(prefix+r, msgs...)
			}
			return prefix
		},
		Source: func(where, reader string) (inbox.Source, error) {
			cfg := f.Src.RabbitMQ
			cfg.Queue = where + reader
			return New(cfg, Options{Name: f.Src.Name, ProbeBackoffMax: f.Cfg.ProbeBackoffMax})
		},
	}
	bench.Run(b)
}

// backlog returns n events over 1,000 aggregates with ids prefix-0,
// prefix-1, ..., about 200 bytes of JSON each, as the outbox's benchmarks
// produce.
func backlog(prefix string, n int) []amqp.Publishing {
	msgs := make([]amqp.Publishing, n)
	for i := range msgs {
		msgs[i] = event(fmt.Sprintf("%s-%d", prefix, i), "order", fmt.Sprintf("order-%d", i%1000), i)
		msgs[i].Body = fmt.Appendf(nil, `{"seq": %d, "order_id": "order-%d", "status": "PAID", "currency": "EUR", "note": %q}`,
			i, i, strings.Repeat("x", 120))
	}
	return msgs
}
