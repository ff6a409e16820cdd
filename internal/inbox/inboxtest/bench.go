package inboxtest

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/inbox"
)

// Bench drains the same messages from a source in three phases per
// round, each reading them afresh (a consumer, group or queue of its
// own), the source in front of: a bare handoff that settles every
// message at once (the source's own loop); the sql handler's statement
// run for the batch in one transaction, then settled (the work without
// the inbox's bookkeeping); the inbox with the sql handler. It prints the rates per
// round and the inbox's ratio to the bare loop and to the plain work,
// min / median / max over the rounds.
type Bench struct {
	Fixture  *Fixture
	Kind     string // the source's kind, for the summary
	Loop     string // the bare loop, as the round lines name it: "consume-and-ack"
	Rounds   int
	Messages int // per phase
	// Load puts Messages messages for round on the broker, and returns
	// where they are (a subject, a topic). readers are the names the
	// round's phases will read through, for a broker that must know its
	// consumers' queues before the messages are published (RabbitMQ).
	Load func(round int, readers []string) string
	// Source returns a source that reads where through a consumer (or
	// group) called reader, new to the broker.
	Source func(where, reader string) (inbox.Source, error)
}

// ConcurrencyEnv names an environment variable that sets the inbox
// phase's inbox.sources[].concurrency, to compare lane counts: the test
// database's pool (pgtest.PoolConns) caps what runs at once.
const ConcurrencyEnv = "WORKER_BENCH_INBOX_CONCURRENCY"

// ReplicasEnv names an environment variable that adds a fourth phase when
// it is 2 or more: the inbox with that many replicas, each a source and a
// consumer on a pool of its own, reading through one consumer, group or
// queue, as replicas of the worker do. The summary gives its rate against
// the one-replica inbox phase's in the same round.
const ReplicasEnv = "WORKER_BENCH_INBOX_REPLICAS"

// Run runs the rounds, b.N times.
func (bn *Bench) Run(b *testing.B) {
	f, n := bn.Fixture, bn.Messages
	if c, err := strconv.Atoi(os.Getenv(ConcurrencyEnv)); err == nil && c > 0 {
		f.Src.Concurrency = c
	}
	replicas, _ := strconv.Atoi(os.Getenv(ReplicasEnv))
	var pools []*pgxpool.Pool // the replicas', one each, for every round
	for range replicas {
		pools = append(pools, f.DB.NewPool(f.T, 0))
	}
	fmt.Printf("%s: inbox concurrency %d\n", bn.Kind, f.Src.Concurrency)
	for range b.N {
		rounds := make([][]float64, 0, bn.Rounds) // bare, plain work, inbox[, inbox × replicas]
		for round := range bn.Rounds {
			handoffs := [][]inbox.Handoff{
				{BareHandoff{}},
				{&plainWork{f: f}},
				{f.Consumer(nil)},
			}
			if replicas > 1 {
				var hs []inbox.Handoff
				for r, pool := range pools {
					hs = append(hs, NewConsumerOn(f.T, pool, f.Src, f.Cfg, inbox.SQLHandler{SQL: f.Src.Handler.SQL}, fmt.Sprintf("replica-%d", r)))
				}
				handoffs = append(handoffs, hs)
			}
			readers := make([]string, len(handoffs))
			for i := range readers {
				readers[i] = fmt.Sprintf("p%d-%d", i, round)
			}
			where := bn.Load(round, readers)
			rates := make([]float64, len(handoffs))
			for k := range handoffs {
				i := (k + round) % len(handoffs) // rotate the order between rounds
				if i > 0 {
					f.Reset()
				}
				rates[i] = bn.phase(where, readers[i], handoffs[i])
			}
			rounds = append(rounds, rates)
			fmt.Printf("round %d: bare %s %.0f msgs/s, plain work %.0f msgs/s, inbox %.0f msgs/s; inbox/bare %.3f, inbox/plain %.2f\n",
				round+1, bn.Loop, rates[0], rates[1], rates[2], rates[2]/rates[0], rates[2]/rates[1])
			if replicas > 1 {
				fmt.Printf("round %d: inbox × %d replicas %.0f msgs/s; ÷ one replica %.2f\n", round+1, replicas, rates[3], rates[3]/rates[2])
			}
		}
		printSummary(b, bn.Kind, n, f.Cfg.BatchSize, replicas, rounds)
	}
}

// phase runs a source on where through reader in front of each of hs,
// until Messages messages are settled processed in all, and returns the
// rate.
func (bn *Bench) phase(where, reader string, hs []inbox.Handoff) float64 {
	t, n := bn.Fixture.T, bn.Messages
	t.Helper()
	c := NewCounting(nil, n) // the count alone: each source hands off to c.Also(h)
	start := time.Now()
	var stops []func() error
	for _, h := range hs {
		s, err := bn.Source(where, reader)
		if err != nil {
			t.Fatal(err)
		}
		stops = append(stops, RunSource(t, s, c.Also(h)))
	}
	select {
	case <-c.Done:
	case <-time.After(5 * time.Minute):
		t.Fatalf("%s: %d of %d messages processed in 5 minutes", reader, c.Settled.Load(), n)
	}
	took := time.Since(start)
	for _, stop := range stops {
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
	return float64(n) / took.Seconds()
}

// BareHandoff settles every delivery processed at once: a source's own
// loop without the inbox.
type BareHandoff struct{}

func (BareHandoff) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		_ = d.Settle(ctx, inbox.Processed, 0)
	}
}
func (BareHandoff) Up()        {}
func (BareHandoff) Down(error) {}

// plainWork runs the sql handler's statement for every message of a batch
// in one transaction, then settles them: the work the inbox does, without
// its claims and dedupe records. The statements go in one round trip, as
// the inbox sends them.
type plainWork struct {
	f *Fixture
}

func (p *plainWork) Process(ctx context.Context, batch []*inbox.Delivery) {
	h := inbox.SQLHandler{SQL: p.f.Src.Handler.SQL}
	err := pgx.BeginFunc(ctx, p.f.DB.Pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		for _, d := range batch {
			h.Queue(b, d.Message)
		}
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		p.f.T.Error(err)
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
func printSummary(b *testing.B, kind string, n, batch, replicas int, rounds [][]float64) {
	col := func(f func(r []float64) float64) []float64 {
		var out []float64
		for _, r := range rounds {
			out = append(out, f(r))
		}
		return out
	}
	bare, plain, full := SpreadOf(col(func(r []float64) float64 { return r[0] })), SpreadOf(col(func(r []float64) float64 { return r[1] })), SpreadOf(col(func(r []float64) float64 { return r[2] }))
	toBare, toPlain := SpreadOf(col(func(r []float64) float64 { return r[2] / r[0] })), SpreadOf(col(func(r []float64) float64 { return r[2] / r[1] }))
	fmt.Printf("%s, %d messages, batch %d, %d rounds (min / median / max):\n  bare loop msgs/s %s\n  plain work msgs/s %s\n  inbox msgs/s %s\n  inbox/bare %s\n  inbox/plain work %s\n",
		kind, n, batch, len(rounds), bare.Text("%.0f"), plain.Text("%.0f"), full.Text("%.0f"), toBare.Text("%.3f"), toPlain.Text("%.2f"))
	if replicas > 1 {
		many, toOne := SpreadOf(col(func(r []float64) float64 { return r[3] })), SpreadOf(col(func(r []float64) float64 { return r[3] / r[2] }))
		fmt.Printf("  inbox × %d replicas msgs/s %s\n  inbox × %d replicas / one replica %s\n", replicas, many.Text("%.0f"), replicas, toOne.Text("%.2f"))
		b.ReportMetric(toOne.Med, "replicas/one")
	}
	b.ReportMetric(toBare.Med, "inbox/bare")
	b.ReportMetric(toPlain.Med, "inbox/plain")
	b.ReportMetric(full.Med, "inbox_msgs/s")
	b.ReportMetric(bare.Med, "bare_msgs/s")
}

// Spread is the min / median / max of a sample.
type Spread struct{ Min, Med, Max float64 }

// SpreadOf returns the spread of xs, which is not empty.
func SpreadOf(xs []float64) Spread {
	s := slices.Sorted(slices.Values(xs))
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return Spread{s[0], med, s[len(s)-1]}
}

// Text formats the spread as "min / median / max", each with format.
func (s Spread) Text(format string) string {
	return fmt.Sprintf(format+" / "+format+" / "+format, s.Min, s.Med, s.Max)
}
