package outbox

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"worker/internal/pgtest"
	"worker/internal/testkit"
)

// Benchmarks of the relay. Run them with
//
//	go test -run '^$' -bench Relay -benchtime 1x -count 5 ./internal/outbox
//
// and compare the ratios, which are measured against a plain-SQL ceiling on
// the same backlog in the same run.

const (
	benchBacklog    = 200_000
	benchAggregates = 1_000
)

// loadBacklog inserts n producer-shaped events (~200-byte JSON payloads)
// over aggs aggregates with one INSERT ... SELECT. The rows go through the
// real insert trigger, so they are exactly what producers write; then the
// table is vacuumed and checkpointed so every measured phase starts alike.
func loadBacklog(tb testing.TB, pool *pgxpool.Pool, n, aggs int) {
	tb.Helper()
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'order', 'order-' || (hashint4(g) & 2147483647) % $2, 'order.updated',
       jsonb_build_object('order_id', 'order-' || g, 'seq', g, 'customer', 'customer-' || g % 977,
                          'status', 'PAID', 'amount_cents', g * 37 % 100000, 'currency', 'EUR',
                          'note', repeat('x', 80)),
       jsonb_build_object('traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01')
FROM generate_series(1, $1) g`, n, aggs)
	if err != nil {
		tb.Fatal(err)
	}
	for _, q := range []string{"VACUUM ANALYZE outbox_event", "CHECKPOINT"} {
		if _, err := pool.Exec(ctx, q); err != nil {
			tb.Fatal(err)
		}
	}
}

// ceilingSQL is the reference loop of PERFORMANCE.md: claim and mark
// PUBLISHED in one statement, no ordering gate, no sink, one write per row.
// It returns the columns a relay needs, as any relay must read them.
const ceilingSQL = `
UPDATE outbox_event SET status = 'PUBLISHED', published_at = clock_timestamp(), attempts = attempts + 1
WHERE id IN (SELECT id FROM outbox_event
             WHERE ` + unfinished + ` AND next_attempt_at <= now()
             ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED)
RETURNING id, event_id::text, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, attempts`

// drainCeiling runs the ceiling loop on conns connections until the table
// is drained and returns rows/s and the CPU seconds its server processes
// used.
func drainCeiling(tb testing.TB, db *pgtest.DB, conns int) (float64, float64) {
	tb.Helper()
	pool := benchPool(tb, db, "bench-ceiling", int32(conns))
	defer pool.Close()
	var total atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range conns {
		wg.Go(func() {
			for {
				rows, err := pool.Query(context.Background(), ceilingSQL)
				if err != nil {
					tb.Error(err)
					return
				}
				n := 0
				for rows.Next() {
					var id int64
					var attempts int
					var eid, at, ai, et string
					var payload, headers []byte
					var occurred time.Time
					if err := rows.Scan(&id, &eid, &at, &ai, &et, &payload, &headers, &occurred, &attempts); err != nil {
						tb.Error(err)
						return
					}
					n++
				}
				if err := rows.Err(); err != nil {
					tb.Error(err)
					return
				}
				if n == 0 {
					return
				}
				total.Add(int64(n))
			}
		})
	}
	wg.Wait()
	el := time.Since(start)
	if total.Load() != benchBacklog {
		tb.Fatalf("ceiling drained %d rows, want %d", total.Load(), benchBacklog)
	}
	return float64(total.Load()) / el.Seconds(), serverCPU(tb, db, "bench-ceiling")
}

// benchPool opens a pool whose sessions carry appName, so serverCPU can
// find their server processes.
func benchPool(tb testing.TB, db *pgtest.DB, appName string, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		tb.Fatal(err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return pool
}

// serverCPU sums the CPU time (user+system, seconds) of the server
// processes of the sessions named appName (prefix match). It is a second,
// load-independent measure: on a shared 2-core machine wall-clock rates
// move with whatever else runs, CPU per row much less.
func serverCPU(tb testing.TB, db *pgtest.DB, appName string) float64 {
	tb.Helper()
	rows, err := db.Pool.Query(context.Background(),
		"SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE $1 || '%'", appName)
	if err != nil {
		tb.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		tb.Fatal(err)
	}
	var ticks int
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			tb.Fatalf("server CPU needs the database on this machine: %v", err)
		}
		f := strings.Fields(string(b)[strings.LastIndexByte(string(b), ')')+2:])
		utime, _ := strconv.Atoi(f[11])
		stime, _ := strconv.Atoi(f[12])
		ticks += utime + stime
	}
	return float64(ticks) / 100 // USER_HZ
}

// countingSink is the no-op sink of the drain benchmark.
type countingSink struct {
	n    atomic.Int64
	want int64
	done chan struct{}
}

func (s *countingSink) Name() string { return "noop" }
func (s *countingSink) Publish(context.Context, Event) error {
	if s.n.Add(1) == s.want {
		close(s.done)
	}
	return nil
}

// drainRelay starts `relays` relays (each its own pool, like replicas) on
// the backlog and returns rows/s until the sink has seen every event and
// all relays have committed.
func drainRelay(tb testing.TB, db *pgtest.DB, relays, batch int) (float64, float64) {
	tb.Helper()
	sink := &countingSink{want: benchBacklog, done: make(chan struct{})}
	cfg := DefaultConfig()
	cfg.BatchSize = batch
	var rs []*Relay
	var pools []*pgxpool.Pool
	for i := range relays {
		pool := benchPool(tb, db, fmt.Sprintf("bench-relay-%d", i), 4)
		pools = append(pools, pool)
		r, err := NewRelay(pool, sink, cfg, fmt.Sprintf("bench-%d", i), nil, nil)
		if err != nil {
			tb.Fatal(err)
		}
		rs = append(rs, r)
	}
	start := time.Now()
	for _, r := range rs {
		if err := r.Start(context.Background()); err != nil {
			tb.Fatal(err)
		}
	}
	select {
	case <-sink.done:
	case <-time.After(5 * time.Minute):
		tb.Fatalf("relay published %d of %d events", sink.n.Load(), benchBacklog)
	}
	// Done means committed, not just handed to the sink.
	testkit.Eventually(tb, time.Minute, "backlog marked published", func() bool {
		var left int
		err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event WHERE `+unfinished).Scan(&left)
		return err == nil && left == 0
	})
	el := time.Since(start)
	cpu := serverCPU(tb, db, "bench-relay")
	for _, r := range rs {
		if err := r.Shutdown(context.Background()); err != nil {
			tb.Fatal(err)
		}
	}
	for _, p := range pools {
		p.Close()
	}
	return benchBacklog / el.Seconds(), cpu
}

// BenchmarkRelayDrain drains a 200,000-event backlog over 1,000 aggregates
// with a no-op sink. Every phase starts from the same backlog: the plain-SQL
// ceiling (1 connection) before and after, and between them the relay with
// the ordering gate: 1 and 2 relays at batch 500 (the ceiling's batch), and
// 1 relay at the default batch 100. Ratios are against the mean of the two
// ceiling runs. It also reports the peak RSS of the process while relays
// drain.
func BenchmarkRelayDrain(b *testing.B) {
	db := pgtest.New(b)
	loadBacklog(b, db.Pool, benchBacklog, benchAggregates)
	saveBacklog(b, db.Pool)
	for range b.N {
		restoreBacklog(b, db.Pool)
		ceilA, ceilCPUA := drainCeiling(b, db, 1)
		resetPeakRSS(b)
		var rate, cpu []float64
		for _, c := range []struct{ relays, batch int }{{1, 500}, {2, 500}, {1, 100}} {
			restoreBacklog(b, db.Pool)
			r, c := drainRelay(b, db, c.relays, c.batch)
			rate, cpu = append(rate, r), append(cpu, c)
		}
		rss := peakRSSMB(b)
		restoreBacklog(b, db.Pool)
		ceilB, ceilCPUB := drainCeiling(b, db, 1)
		ceiling, ceilCPU := (ceilA+ceilB)/2, (ceilCPUA+ceilCPUB)/2
		b.ReportMetric(ceiling, "ceiling_rows/s")
		for i, name := range []string{"relay1", "relay2", "relay1_b100"} {
			b.ReportMetric(rate[i], name+"_rows/s")
			b.ReportMetric(rate[i]/ceiling, name+"_ratio")
			// Server CPU per row, ceiling over relay: the same ratio with
			// the machine's other load taken out.
			b.ReportMetric(ceilCPU/cpu[i], name+"_cpu_ratio")
		}
		b.ReportMetric(rss, "peak_rss_MB")
	}
}

// saveBacklog keeps a copy of the loaded backlog, so every phase can start
// from exactly the same rows without paying for the trigger path again.
func saveBacklog(tb testing.TB, pool *pgxpool.Pool) {
	tb.Helper()
	if _, err := pool.Exec(context.Background(), "CREATE TABLE bench_backlog AS SELECT * FROM outbox_event"); err != nil {
		tb.Fatal(err)
	}
}

// restoreBacklog replaces the table's contents with the saved backlog. The
// user triggers are off while copying: the rows already went through them
// once, and the copy keeps their ids and event_ids.
func restoreBacklog(tb testing.TB, pool *pgxpool.Pool) {
	tb.Helper()
	for _, q := range []string{
		"TRUNCATE outbox_event",
		"ALTER TABLE outbox_event DISABLE TRIGGER USER",
		"INSERT INTO outbox_event SELECT * FROM bench_backlog",
		"ALTER TABLE outbox_event ENABLE TRIGGER USER",
		"VACUUM ANALYZE outbox_event",
		"CHECKPOINT",
	} {
		if _, err := pool.Exec(context.Background(), q); err != nil {
			tb.Fatal(err)
		}
	}
}

// BenchmarkRelayLatency inserts 500 events/s for 20 s, each in its own
// producer transaction over 100 aggregates, with one relay running, and
// reports commit-to-sink latency percentiles.
func BenchmarkRelayLatency(b *testing.B) {
	const rate, dur = 500, 20 * time.Second
	for range b.N {
		db := pgtest.New(b)
		sink := newLatencySink()
		cfg := DefaultConfig()
		r, err := NewRelay(db.NewPool(b, 4), sink, cfg, "bench", nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		if err := r.Start(context.Background()); err != nil {
			b.Fatal(err)
		}
		total := int(rate * dur / time.Second)
		producers := db.NewPool(b, 8)
		var wg sync.WaitGroup
		start := time.Now()
		// Four producers, each on its own schedule of rate/4 per second, so a
		// slow commit delays only one of them.
		for p := range 4 {
			wg.Go(func() {
				for i := p; i < total; i += 4 {
					time.Sleep(time.Until(start.Add(time.Duration(i) * time.Second / rate)))
					var id string
					err := producers.QueryRow(context.Background(),
						`INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
						 VALUES ('order', $1, 'order.updated', $2) RETURNING event_id::text`,
						fmt.Sprintf("order-%d", i%100), fmt.Sprintf(`{"seq": %d, "note": %q}`, i, strings.Repeat("x", 150))).Scan(&id)
					if err != nil {
						b.Error(err)
						return
					}
					sink.committed(id, time.Now())
				}
			})
		}
		wg.Wait()
		testkit.Eventually(b, time.Minute, "all events published", func() bool { return sink.count() == total })
		if err := r.Shutdown(context.Background()); err != nil {
			b.Fatal(err)
		}
		lat := sink.latencies()
		b.ReportMetric(ms(percentile(lat, 0.50)), "p50_ms")
		b.ReportMetric(ms(percentile(lat, 0.99)), "p99_ms")
		b.ReportMetric(ms(percentile(lat, 1)), "max_ms")
	}
}

// latencySink records when each event reached it; producers record when
// their commit returned. Latency is the difference (0 when the relay was
// faster than the producer's commit acknowledgement).
type latencySink struct {
	mu      sync.Mutex
	arrived map[string]time.Time
	commits map[string]time.Time
}

func newLatencySink() *latencySink {
	return &latencySink{arrived: map[string]time.Time{}, commits: map[string]time.Time{}}
}

func (s *latencySink) Name() string { return "latency" }

func (s *latencySink) Publish(_ context.Context, e Event) error {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.arrived[e.EventID]; !dup {
		s.arrived[e.EventID] = now
	}
	return nil
}

func (s *latencySink) committed(id string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.commits[id] = at
}

func (s *latencySink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.arrived)
}

func (s *latencySink) latencies() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]time.Duration, 0, len(s.commits))
	for id, c := range s.commits {
		out = append(out, max(0, s.arrived[id].Sub(c)))
	}
	slices.Sort(out)
	return out
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// resetPeakRSS clears the kernel's peak-RSS mark (VmHWM) of this process, so
// the next reading covers only what follows.
func resetPeakRSS(tb testing.TB) {
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		tb.Fatalf("reset peak RSS: %v", err)
	}
}

// peakRSSMB reads VmHWM (peak resident set) from /proc/self/status.
func peakRSSMB(tb testing.TB) float64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			if err != nil {
				tb.Fatal(err)
			}
			return float64(kb) / 1024
		}
	}
	tb.Fatal("VmHWM not found in /proc/self/status")
	return 0
}
