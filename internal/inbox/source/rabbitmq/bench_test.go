package rabbitmq

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
)

var (
	benchRounds   = flag.Int("rounds", 3, "BenchmarkInboxRabbitMQ: rounds (the phase order alternates between rounds)")
	benchMessages = flag.Int("messages", 20000, "BenchmarkInboxRabbitMQ: messages per phase")
	benchPrefetch = flag.Int("prefetch", inbox.DefaultSource().RabbitMQ.Prefetch, "BenchmarkInboxRabbitMQ: prefetch of both phases")
)

// BenchmarkInboxRabbitMQ drains the same backlog from the same queue
// twice per round: through the inbox (the source, the consumer and the
// sql handler, each message's work and dedupe record committed before its
// ack) and through the bare loop that only consumes and acknowledges,
// with the same prefetch (the default, or -prefetch). It prints each round's rates and their
// ratio, then min / median / max over the rounds.
//
//	go test -run '^$' -bench InboxRabbitMQ -benchtime 1x -rounds 5 ./internal/inbox/source/rabbitmq
func BenchmarkInboxRabbitMQ(b *testing.B) {
	queue := newQueue(b)
	f := newFixture(b, nil)
	pub := newPublisher(b)
	n := *benchMessages
	load := func(round int, phase string) {
		// A quorum queue may drop the acks sent just before a phase's
		// connection closed (rabbitmq-server#10327): those messages are
		// back, and belong to no phase.
		purge(b, queue)
		msgs := make([]amqp.Publishing, n)
		for i := range msgs {
			// About 200 bytes of JSON, over 100 aggregates, as the outbox's
			// benchmarks produce.
			msgs[i] = event(fmt.Sprintf("r%d-%s-%d", round, phase, i), "order", fmt.Sprintf("order-%d", i%100), i)
			msgs[i].Body = fmt.Appendf(nil, `{"seq": %d, "order_id": "order-%d", "status": "PAID", "currency": "EUR", "note": %q}`,
				i, i, strings.Repeat("x", 120))
		}
		pub.publish(queue, msgs...)
	}
	phases := []string{"bare", "inbox"}
	for range b.N {
		rates := map[string][]float64{}
		var ratios, batches []float64
		for round := range *benchRounds {
			got := map[string]float64{}
			for k := range phases {
				phase := phases[(k+round)%len(phases)]
				load(round, phase)
				if phase == "bare" {
					got[phase] = drainBare(b, queue, n)
				} else {
					var batch float64
					got[phase], batch = drainInbox(b, f, queue, n)
					batches = append(batches, batch)
				}
				rates[phase] = append(rates[phase], got[phase])
			}
			ratios = append(ratios, got["inbox"]/got["bare"])
			fmt.Printf("round %d: bare consume-and-ack %.0f msgs/s, inbox %.0f msgs/s, ratio %.2f\n",
				round+1, got["bare"], got["inbox"], got["inbox"]/got["bare"])
		}
		load, _ := os.ReadFile("/proc/loadavg")
		bare, inb, ratio := inboxtest.SpreadOf(rates["bare"]), inboxtest.SpreadOf(rates["inbox"]), inboxtest.SpreadOf(ratios)
		fmt.Printf("inbox rabbitmq, %d messages a phase, prefetch %d, batch_size %d, %d rounds, %d cpus, load %s:\n"+
			"  bare %.0f / %.0f / %.0f msgs/s, inbox %.0f / %.0f / %.0f msgs/s, ratio %.2f / %.2f / %.2f (min / median / max); mean batch %.0f\n",
			n, *benchPrefetch, inbox.DefaultConfig().BatchSize, *benchRounds, runtime.NumCPU(),
			strings.Join(strings.Fields(string(load))[:3], " "),
			bare.Min, bare.Med, bare.Max, inb.Min, inb.Med, inb.Max, ratio.Min, ratio.Med, ratio.Max, inboxtest.SpreadOf(batches).Med)
		b.ReportMetric(bare.Med, "bare_msgs/s")
		b.ReportMetric(inb.Med, "inbox_msgs/s")
		b.ReportMetric(ratio.Med, "ratio")
	}
}

// drainBare consumes n messages with -prefetch, acknowledging
// each, and returns the rate.
func drainBare(tb testing.TB, queue string, n int) float64 {
	tb.Helper()
	ch, err := requireBroker(tb).Channel()
	if err != nil {
		tb.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Qos(*benchPrefetch, 0, false); err != nil {
		tb.Fatal(err)
	}
	start := time.Now()
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		tb.Fatal(err)
	}
	for range n {
		d, ok := <-ds
		if !ok {
			tb.Fatal("the deliveries stopped")
		}
		if err := d.Ack(false); err != nil {
			tb.Fatal(err)
		}
	}
	return float64(n) / time.Since(start).Seconds()
}

// drainInbox runs the source with the default configuration and -prefetch until n
// messages were processed, and returns the rate and the mean batch.
func drainInbox(tb testing.TB, f *fixture, queue string, n int) (rate, batch float64) {
	tb.Helper()
	ctx := context.Background()
	if _, err := f.db.Pool.Exec(ctx, `TRUNCATE work, inbox_message`); err != nil {
		tb.Fatal(err)
	}
	if _, err := f.db.Pool.Exec(ctx, `VACUUM ANALYZE work, inbox_message`); err != nil {
		tb.Fatal(err)
	}
	c := inboxtest.NewCounting(f.c, n)
	src := newSource(tb, queue, "", func(c *inbox.RabbitMQSource) { c.Prefetch = *benchPrefetch })
	start := time.Now()
	stop := runUntil(tb, src, c)
	select {
	case <-c.Done:
	case <-time.After(5 * time.Minute):
		tb.Fatalf("%d of %d messages processed within 5 minutes", c.Settled.Load(), n)
	}
	rate = float64(n) / time.Since(start).Seconds()
	stop()
	if got := f.count(tb, `SELECT count(*) FROM work`); got != n {
		tb.Fatalf("%d pieces of work for %d messages", got, n)
	}
	return rate, float64(n) / float64(c.Batches.Load())
}

// purge empties queue.
func purge(tb testing.TB, queue string) {
	tb.Helper()
	ch, err := requireBroker(tb).Channel()
	if err != nil {
		tb.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueuePurge(queue, false); err != nil {
		tb.Fatal(err)
	}
}
