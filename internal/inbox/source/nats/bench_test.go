package nats

import (
	"flag"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
)

var (
	benchRounds   = flag.Int("rounds", 3, "inbox benchmark: rounds (phase order alternates between rounds)")
	benchMessages = flag.Int("messages", 20000, "inbox benchmark: messages per phase")
	benchBatch    = flag.Int("batch", 100, "inbox benchmark: inbox.batch_size")
	benchPending  = flag.Int("max-ack-pending", 0, "inbox benchmark: the consumers' nats.max_ack_pending (1: ordered mode); 0 keeps the default")
)

// BenchmarkInboxNATS drains the same messages (over 1,000 aggregates, one
// subject per round) from an in-process server in three phases per
// round, each through a durable consumer of its own, the source in front
// of: a bare handoff that acks every message at once (the source's own
// consume-and-ack loop); the sql handler's statement run for the batch in
// one transaction, then acks (the work without the inbox's bookkeeping);
// the inbox with the sql handler. It prints the rates per round and the
// inbox's ratio to the bare loop and to the plain work, min / median /
// max over -rounds.
//
//	go test -run '^$' -bench InboxNATS -benchtime 1x ./internal/inbox/source/nats -rounds 5
//	go test -run '^$' -bench InboxNATS -benchtime 1x ./internal/inbox/source/nats -max-ack-pending 1 -messages 3000
func BenchmarkInboxNATS(b *testing.B) {
	srv := startServer(b)
	srv.createStream(b)
	js := srv.js(b)
	f := newFixture(b, srv)
	f.Cfg.BatchSize = *benchBatch
	bench := &inboxtest.Bench{
		Fixture: f.Fixture, Kind: "nats", Loop: "consume-and-ack", Rounds: *benchRounds, Messages: *benchMessages,
		Load: func(round int, _ []string) string {
			subject := fmt.Sprintf("in.bench-%d", round)
			publishBacklog(b, js, subject, fmt.Sprintf("r%d", round), *benchMessages)
			return subject
		},
		// A durable consumer of its own on subject.
		Source: func(subject, consumer string) (inbox.Source, error) {
			src := f.Src
			src.NATS.Consumer = consumer
			src.NATS.FilterSubject = subject
			src.NATS.AckWait = time.Minute
			if *benchPending > 0 {
				src.NATS.MaxAckPending = *benchPending
			}
			return New(src, f.Cfg, nil)
		},
	}
	bench.Run(b)
}

// publishBacklog publishes n messages over 1,000 aggregates on subject,
// asynchronously, and waits for the stream's acks.
func publishBacklog(b *testing.B, js jetstream.JetStream, subject, prefix string, n int) {
	b.Helper()
	for i := range n {
		h := nats.Header{}
		h.Set("ce-specversion", "1.0")
		h.Set("ce-id", fmt.Sprintf("%s-%d", prefix, i))
		h.Set("ce-source", "order")
		h.Set("ce-subject", fmt.Sprintf("order-%d", i%1000))
		h.Set("ce-type", "order.updated")
		h.Set("content-type", "application/json")
		body := fmt.Appendf(nil, `{"order_id": "order-%d", "seq": %d, "status": "PAID", "note": "%080d"}`, i, i, 0)
		if _, err := js.PublishMsgAsync(&nats.Msg{Subject: subject, Header: h, Data: body}); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("the backlog was not acknowledged within a minute")
	}
}
