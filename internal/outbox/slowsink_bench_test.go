package outbox

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
)

var (
	slowLatencies       = flag.String("latencies", "20ms,150ms,400ms,1s", "BenchmarkRelaySlowSink: the sink latencies, comma-separated")
	slowAggregateCounts = flag.String("aggregates", "200,2000", "BenchmarkRelaySlowSink: the backlogs' numbers of aggregates, comma-separated")
	slowShapes          = flag.String("shapes", "1x1,3x2", "BenchmarkRelaySlowSink: replicas x loops per replica, comma-separated")
)

// BenchmarkRelaySlowSink drains backlogs through a sink that answers every
// publish after a fixed latency L, with 1 replica of 1 loop and with 3
// replicas of 2 loops (-shapes; relays in this process, a pool each), over
// 200 and 2,000 aggregates (-aggregates), the backlog committed in 1
// transaction and in 10. It prints events/s min / median / max over
// -rounds and the median ratio to the most any relay could do:
// min(max_in_flight x replicas, aggregates) / L, since one aggregate's
// events go one at a time.
//
//	go test -run '^$' -bench RelaySlowSink -timeout 30m ./internal/outbox [-args -latencies=20ms,50ms -aggregates=10,10000 -shapes=1x2 -rounds=3]
func BenchmarkRelaySlowSink(b *testing.B) {
	type shape struct {
		latency         time.Duration
		replicas, loops int
		aggregates, txs int
	}
	var shapes []shape
	var latencies []time.Duration
	for f := range strings.SplitSeq(*slowLatencies, ",") {
		l, err := time.ParseDuration(f)
		if err != nil {
			b.Fatalf("-latencies: %v", err)
		}
		latencies = append(latencies, l)
	}
	var aggregates []int
	for f := range strings.SplitSeq(*slowAggregateCounts, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			b.Fatalf("-aggregates: %q is not a positive number", f)
		}
		aggregates = append(aggregates, n)
	}
	var replicasLoops [][2]int
	for f := range strings.SplitSeq(*slowShapes, ",") {
		var r, l int
		if _, err := fmt.Sscanf(f, "%dx%d", &r, &l); err != nil || r < 1 || l < 1 {
			b.Fatalf("-shapes: %q is not replicas x loops, such as 3x2", f)
		}
		replicasLoops = append(replicasLoops, [2]int{r, l})
	}
	for _, l := range latencies {
		for _, rl := range replicasLoops {
			for _, aggs := range aggregates {
				for _, txs := range []int{1, 10} {
					shapes = append(shapes, shape{l, rl[0], rl[1], aggs, txs})
				}
			}
		}
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "L\treplicas x loops\taggregates\ttransactions\tevents\tevents/s min / median / max\tideal\tratio\t")
	for range b.N {
		for _, s := range shapes {
			cfg := outboxconfig.DefaultConfig()
			cfg.Relays = s.loops
			ideal := float64(min(outboxconfig.DefaultMaxInFlight(outboxconfig.SinkWebhook)*s.replicas, s.aggregates)) / s.latency.Seconds()
			// About 8 s of draining at the ideal rate.
			events := int(8 * ideal)
			var rates []float64
			for round := range *benchRounds {
				// A sub-benchmark each, so that its relays, pools and
				// database are gone before the next round starts.
				name := fmt.Sprintf("%s/%dx%d/%d-aggregates/%d-txs/round-%d", s.latency, s.replicas, s.loops, s.aggregates, s.txs, round)
				b.Run(name, func(b *testing.B) {
					rates = append(rates, drainSlow(b, cfg, s.latency, s.replicas, events, s.aggregates, s.txs))
				})
			}
			slices.Sort(rates)
			med := rates[len(rates)/2]
			fmt.Fprintf(w, "%s\t%d x %d\t%d\t%d\t%d\t%.0f / %.0f / %.0f\t%.0f\t%.2f\t\n",
				s.latency, s.replicas, s.loops, s.aggregates, s.txs, events, rates[0], med, rates[len(rates)-1], ideal, med/ideal)
		}
	}
	w.Flush()
}

// drainSlow loads the backlog, starts the relays and returns the events/s
// from their start until the sink has taken every event.
func drainSlow(b *testing.B, cfg outboxconfig.Config, latency time.Duration, replicas, events, aggregates, txs int) float64 {
	// A replica's pool holds its loops' connections and three for
	// completions and metrics; its listener has one of its own.
	poolConns := cfg.Relays + 3
	pgtest.Need(b, 1+pgtest.PoolConns+replicas*(poolConns+1))
	db := pgtest.New(b)
	loadBacklogIn(b, db.Pool, events, aggregates, txs)
	sink := &slowSink{delay: latency}
	start := time.Now()
	for range replicas {
		startRelay(b, db.NewPool(b, int32(poolConns)), sink, cfg, nil)
	}
	deadline := time.Now().Add(10 * time.Minute)
	for sink.n.Load() < int64(events) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	return float64(sink.n.Load()) / time.Since(start).Seconds()
}

// slowSink answers every publish after delay.
type slowSink struct {
	delay time.Duration
	n     atomic.Int64
}

func (s *slowSink) Name() string { return outboxconfig.SinkWebhook }

func (s *slowSink) Publish(ctx context.Context, e Event) error {
	t := time.NewTimer(s.delay)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
	}
	s.n.Add(1)
	return nil
}

// loadBacklogIn inserts n events over aggs aggregates, round robin, in txs
// transactions, each a consecutive slice of the events.
func loadBacklogIn(tb testing.TB, pool *pgxpool.Pool, n, aggs, txs int) {
	tb.Helper()
	per := (n + txs - 1) / txs
	for lo := 0; lo < n; lo += per {
		_, err := pool.Exec(context.Background(), `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', 'order-' || g % $3, 'order.updated', jsonb_build_object('seq', g)
FROM generate_series($1::int, $2::int - 1) g`, lo, min(n, lo+per), aggs)
		if err != nil {
			tb.Fatal(err)
		}
	}
}
