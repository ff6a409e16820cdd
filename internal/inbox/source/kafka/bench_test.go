package kafka

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/inbox"
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
	f.cfg.BatchSize = *benchBatch
	n := *benchMessages
	for range b.N {
		rounds := make([][3]float64, 0, *benchRounds) // bare, plain work, inbox
		for round, topic := range topics {
			produceBacklog(b, c, topic, fmt.Sprintf("r%d", round), n)
			handoffs := []func() inbox.Handoff{
				func() inbox.Handoff { return bareHandoff{} },
				func() inbox.Handoff { f.reset(); return &plainWork{f: f} },
				func() inbox.Handoff { f.reset(); return f.consumer(nil) },
			}
			var rates [3]float64
			for k := range handoffs {
				i := (k + round) % len(handoffs) // rotate the order between rounds
				rates[i] = f.benchPhase(topic, fmt.Sprintf("p%d-%d", i, round), handoffs[i](), n)
			}
			rounds = append(rounds, rates)
			fmt.Printf("round %d: bare poll-and-commit %.0f msgs/s, plain work %.0f msgs/s, inbox %.0f msgs/s; inbox/bare %.3f, inbox/plain %.2f\n",
				round+1, rates[0], rates[1], rates[2], rates[2]/rates[0], rates[2]/rates[1])
		}
		printSummary(b, "kafka", n, f.cfg.BatchSize, rounds)
	}
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

// benchPhase runs the source with a group of its own on topic, in front
// of h, until n records are settled processed, and returns the rate.
func (f *fixture) benchPhase(topic, group string, h inbox.Handoff, n int) float64 {
	f.t.Helper()
	src := f.src
	src.Kafka.Topics, src.Kafka.Group = topic, group
	s, err := New(src, f.cfg, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	c := &counting{Handoff: h, want: int64(n), done: make(chan struct{})}
	start := time.Now()
	stop := runSource(f.t, s, c)
	select {
	case <-c.done:
	case <-time.After(5 * time.Minute):
		f.t.Fatalf("%s: %d of %d records processed in 5 minutes", group, c.n.Load(), n)
	}
	took := time.Since(start)
	if err := stop(); err != nil {
		f.t.Fatal(err)
	}
	return float64(n) / took.Seconds()
}

// reset empties the inbox and the work table between phases.
func (f *fixture) reset() {
	for _, q := range []string{"TRUNCATE inbox_message, seen", "VACUUM ANALYZE inbox_message", "VACUUM ANALYZE seen"} {
		if _, err := f.db.Pool.Exec(context.Background(), q); err != nil {
			f.t.Fatal(err)
		}
	}
}

// bareHandoff settles every delivery processed at once: the source's
// poll-and-commit loop without the inbox.
type bareHandoff struct{}

func (bareHandoff) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		_ = d.Settle(ctx, inbox.Processed, 0)
	}
}
func (bareHandoff) Up()        {}
func (bareHandoff) Down(error) {}

// counting passes a Handoff's calls on and closes done once want
// deliveries were settled processed.
type counting struct {
	inbox.Handoff
	n    atomic.Int64
	want int64
	done chan struct{}
}

func (c *counting) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		settle := d.Settle
		d.Settle = func(ctx context.Context, o inbox.Outcome, after time.Duration) error {
			err := settle(ctx, o, after)
			if o == inbox.Processed && c.n.Add(1) == c.want {
				close(c.done)
			}
			return err
		}
	}
	c.Handoff.Process(ctx, batch)
}

// plainWork runs the sql handler's statement for every message of a batch
// in one transaction, then settles them: the work the inbox does, without its
// claims and dedupe records.
type plainWork struct {
	f *fixture
}

func (p *plainWork) Process(ctx context.Context, batch []*inbox.Delivery) {
	h := inbox.SQLHandler{SQL: p.f.src.Handler.SQL}
	err := pgx.BeginFunc(ctx, p.f.db.Pool, func(tx pgx.Tx) error {
		for _, d := range batch {
			if err := h.Handle(ctx, tx, d.Message); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		p.f.t.Error(err)
		return
	}
	for _, d := range batch {
		_ = d.Settle(ctx, inbox.Processed, 0)
	}
}
func (*plainWork) Up()        {}
func (*plainWork) Down(error) {}

// printSummary prints min / median / max of each phase's rate and of the
// inbox's ratios, and reports the medians.
func printSummary(b *testing.B, source string, n, batch int, rounds [][3]float64) {
	col := func(f func(r [3]float64) float64) []float64 {
		var out []float64
		for _, r := range rounds {
			out = append(out, f(r))
		}
		return out
	}
	bare, plain, full := col(func(r [3]float64) float64 { return r[0] }), col(func(r [3]float64) float64 { return r[1] }), col(func(r [3]float64) float64 { return r[2] })
	toBare, toPlain := col(func(r [3]float64) float64 { return r[2] / r[0] }), col(func(r [3]float64) float64 { return r[2] / r[1] })
	fmt.Printf("%s, %d messages, batch %d, %d rounds (min / median / max):\n  bare loop msgs/s %s\n  plain work msgs/s %s\n  inbox msgs/s %s\n  inbox/bare %s\n  inbox/plain work %s\n",
		source, n, batch, len(rounds), spreadOf(bare, "%.0f"), spreadOf(plain, "%.0f"), spreadOf(full, "%.0f"), spreadOf(toBare, "%.3f"), spreadOf(toPlain, "%.2f"))
	b.ReportMetric(median(toBare), "inbox/bare")
	b.ReportMetric(median(toPlain), "inbox/plain")
	b.ReportMetric(median(full), "inbox_msgs/s")
	b.ReportMetric(median(bare), "bare_msgs/s")
}

func spreadOf(xs []float64, format string) string {
	s := slices.Sorted(slices.Values(xs))
	return fmt.Sprintf(format+" / "+format+" / "+format, s[0], median(s), s[len(s)-1])
}

func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}
