package kafka

import (
	"context"
	"flag"
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
)

var (
	benchRounds   = flag.Int("rounds", 3, "inbox benchmark: rounds (phase order alternates between rounds)")
	benchMessages = flag.Int("messages", 20000, "inbox benchmark: records per phase")
	benchBatch    = flag.Int("batch", 100, "inbox benchmark: inbox.batch_size")
)

// BenchmarkInboxKafka drains the same records (over 1,000 aggregates,
// one topic of 3 partitions per round) from an in-process cluster in
// three phases per round, each through a consumer group of its own, the
// source in front of: a bare handoff that settles every record at once
// (the source's own poll-and-commit loop); the sql handler's statement run
// for the batch in one transaction (the work without the inbox's
// bookkeeping); the inbox with the sql handler. It prints the rates per
// round and the inbox's ratio to the bare loop and to the plain work,
// min / median / max over -rounds.
//
//	go test -run '^$' -bench InboxKafka -benchtime 1x ./internal/inbox/source/kafka -rounds 5
func BenchmarkInboxKafka(b *testing.B) {
	var topics []string
	for round := range *benchRounds {
		topics = append(topics, fmt.Sprintf("bench-%d", round))
	}
	cl := startCluster(b, kfake.SeedTopics(partitions, topics...))
	c := cl.client(b)
	f := newFixture(b, cl)
	f.Cfg.BatchSize = *benchBatch
	bench := &inboxtest.Bench{
		Fixture: f.Fixture, Kind: "kafka", Loop: "poll-and-commit", Rounds: *benchRounds, Messages: *benchMessages,
		Load: func(round int, _ []string) string {
			produceBacklog(b, c, topics[round], fmt.Sprintf("r%d", round), *benchMessages)
			return topics[round]
		},
		// A group of its own on topic.
		Source: func(topic, group string) (inbox.Source, error) {
			src := f.Src
			src.Kafka.Topics, src.Kafka.Group = topic, group
			return New(src, f.Cfg, nil)
		},
	}
	bench.Run(b)
}

// produceBacklog produces n records over 1,000 aggregates to topic, keyed
// by aggregate as the outbox's sink keys them.
func produceBacklog(b *testing.B, c *kgo.Client, topic, prefix string, n int) {
	b.Helper()
	recs := make([]*kgo.Record, n)
	for i := range recs {
		agg := fmt.Sprintf("order-%d", i%1000)
		recs[i] = &kgo.Record{Topic: topic, Key: []byte("order:" + agg), Headers: []kgo.RecordHeader{
			{Key: "content-type", Value: []byte("application/json")},
			{Key: "ce_specversion", Value: []byte("1.0")},
			{Key: "ce_id", Value: fmt.Appendf(nil, "%s-%d", prefix, i)},
			{Key: "ce_source", Value: []byte("order")},
			{Key: "ce_subject", Value: []byte(agg)},
			{Key: "ce_type", Value: []byte("order.updated")},
		}, Value: fmt.Appendf(nil, `{"order_id": "order-%d", "seq": %d, "status": "PAID", "note": "%080d"}`, i, i, 0)}
	}
	if err := c.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		b.Fatal(err)
	}
}
