package lock

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Run with
//
//	go test -run '^$' -bench 'PostgresAcquireRelease|BaselineUpdateReturning' -benchtime 2000x -count 5 ./internal/lock
//
// (add |TryHeld|Handover for the other two).
//
// An acquire + release is two commits (the release's without waiting for
// its WAL flush), so the yardstick is one single-row UPDATE ... RETURNING
// commit, the baseline, measured on the same
// server in the same run and on the same kind of pool (pgtest's NewPool,
// default pgx settings, so the same prepared-statement mode), with its
// statement prepared before the timer starts, on a table shaped like
// worker_lock's use of it (text primary key, one hot row, fillfactor 50).
//
// Compare the pair with the baseline through
// BenchmarkPostgresAcquireReleaseVsBaseline: it alternates the two within
// every iteration, on one pool, so that load elsewhere on the machine (which
// moves fsync times a lot) hits both alike, and reports pair/baseline, the
// ratio of their mean latencies. Means, not medians: under load a commit
// is sometimes slow (it waits for another flush), and the median of a sum
// of two commits then overstates twice the median of one; means add up.
// BenchmarkPostgresAcquireRelease and BenchmarkBaselineUpdateReturning time
// each alone; their ns/op are comparable only on an otherwise idle machine.

// benchKey is the single key the benchmarks take and give back.
const benchKey = "bench"

// baselineSQL is the yardstick: one single-row UPDATE ... RETURNING.
const baselineSQL = `UPDATE bench_counter SET n = n + 1 WHERE key = $1 RETURNING n`

// newBenchBaselineTable creates the baseline's table and row in db.
func newBenchBaselineTable(b *testing.B, db *pgtest.DB) {
	b.Helper()
	_, err := db.Pool.Exec(context.Background(), `
CREATE TABLE bench_counter (key text PRIMARY KEY, n bigint NOT NULL) WITH (fillfactor = 50);
INSERT INTO bench_counter VALUES ('`+benchKey+`', 0)`)
	if err != nil {
		b.Fatal(err)
	}
}

func benchBaselineUpdate(b *testing.B, pool *pgxpool.Pool) {
	var n int64
	if err := pool.QueryRow(context.Background(), baselineSQL, benchKey).Scan(&n); err != nil {
		b.Fatal(err)
	}
}

func benchAcquireRelease(b *testing.B, p *Postgres) {
	ctx := context.Background()
	l, err := p.TryAcquire(ctx, benchKey, 0, 30*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		b.Fatal(err)
	}
}

// One uncontended acquire + release: two single statements, two commits.
// The first pair, outside the timer, creates the key's row and prepares
// the statements; every timed acquire takes over a released row.
func BenchmarkPostgresAcquireRelease(b *testing.B) {
	p := newPostgres(b, pgtest.New(b), nil)
	benchAcquireRelease(b, p)
	for b.Loop() {
		benchAcquireRelease(b, p)
	}
}

// The floor: one single-row UPDATE ... RETURNING commit, on a pool made the
// same way as the provider's (newPostgres uses pgtest's NewPool too).
func BenchmarkBaselineUpdateReturning(b *testing.B) {
	db := pgtest.New(b)
	newBenchBaselineTable(b, db)
	pool := db.NewPool(b, 0)
	benchBaselineUpdate(b, pool)
	for b.Loop() {
		benchBaselineUpdate(b, pool)
	}
}

// Each iteration runs one acquire + release and one baseline UPDATE, in
// alternating order, both on the provider's own pool, and times each. It
// reports their mean and median latencies and pair/baseline, the ratio of
// the means (the goal is at most 2). ns/op is the sum of both.
func BenchmarkPostgresAcquireReleaseVsBaseline(b *testing.B) {
	db := pgtest.New(b)
	newBenchBaselineTable(b, db)
	p := newPostgres(b, db, nil)
	benchAcquireRelease(b, p)
	benchBaselineUpdate(b, p.pool)
	var pair, base []time.Duration
	for i := 0; b.Loop(); i++ {
		for j := range 2 {
			start := time.Now()
			if (i+j)%2 == 0 {
				benchAcquireRelease(b, p)
				pair = append(pair, time.Since(start))
			} else {
				benchBaselineUpdate(b, p.pool)
				base = append(base, time.Since(start))
			}
		}
	}
	mp, mb := benchMeanUS(pair), benchMeanUS(base)
	b.ReportMetric(mp, "pair-mean-us")
	b.ReportMetric(mb, "baseline-mean-us")
	b.ReportMetric(benchMedianUS(pair), "pair-median-us")
	b.ReportMetric(benchMedianUS(base), "baseline-median-us")
	b.ReportMetric(mp/mb, "pair/baseline")
}

// A single try on a key another replica holds, alternated with the
// baseline UPDATE on the trying provider's pool. It writes nothing, so it
// should cost well under one commit: held/baseline is the ratio of the
// mean latencies.
func BenchmarkPostgresTryHeldVsBaseline(b *testing.B) {
	ctx := context.Background()
	db := pgtest.New(b)
	newBenchBaselineTable(b, db)
	holder := newPostgres(b, db, nil)
	if _, err := holder.TryAcquire(ctx, benchKey, 0, time.Hour); err != nil {
		b.Fatal(err)
	}
	p := newPostgres(b, db, nil)
	try := func() {
		if _, err := p.TryAcquire(ctx, benchKey, 0, time.Minute); !IsTimeout(err) {
			b.Fatalf("TryAcquire of a held key = %v, want a timeout", err)
		}
	}
	try()
	benchBaselineUpdate(b, p.pool)
	var held, base []time.Duration
	for i := 0; b.Loop(); i++ {
		for j := range 2 {
			start := time.Now()
			if (i+j)%2 == 0 {
				try()
				held = append(held, time.Since(start))
			} else {
				benchBaselineUpdate(b, p.pool)
				base = append(base, time.Since(start))
			}
		}
	}
	mh, mb := benchMeanUS(held), benchMeanUS(base)
	b.ReportMetric(mh, "held-mean-us")
	b.ReportMetric(mb, "baseline-mean-us")
	b.ReportMetric(mh/mb, "held/baseline")
}

// benchMeanUS and benchMedianUS return microseconds.
func benchMeanUS(d []time.Duration) float64 {
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return float64(sum.Nanoseconds()) / 1000 / float64(len(d))
}

func benchMedianUS(d []time.Duration) float64 {
	slices.Sort(d)
	return float64(d[len(d)/2].Nanoseconds()) / 1000
}

// Handover: from holder A's Release returning to waiter B's TryAcquire
// returning with the lease, B being another replica parked on the key.
func BenchmarkPostgresHandover(b *testing.B) {
	ctx := context.Background()
	db := pgtest.New(b)
	parked := make(chan struct{}, 1)
	holder := newPostgres(b, db, nil)
	waiter := newPostgres(b, db, nil, withWaitHook(func(string) {
		select {
		case parked <- struct{}{}:
		default:
		}
	}))
	for waiter.connects.Load() == 0 { // measure the notification path, not the poll
		time.Sleep(time.Millisecond)
	}
	type result struct {
		l   Lease
		err error
		at  time.Time
	}
	var lat []time.Duration
	for b.Loop() {
		la, err := holder.TryAcquire(ctx, "k", 0, 30*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		res := make(chan result, 1)
		go func() {
			l, err := waiter.TryAcquire(ctx, "k", 10*time.Second, 30*time.Second)
			res <- result{l, err, time.Now()}
		}()
		<-parked
		if err := la.Release(ctx); err != nil {
			b.Fatal(err)
		}
		released := time.Now()
		r := <-res
		if r.err != nil {
			b.Fatal(r.err)
		}
		lat = append(lat, r.at.Sub(released))
		if err := r.l.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "handover-median-ms")
	b.ReportMetric(float64(lat[len(lat)*95/100].Microseconds())/1000, "handover-p95-ms")
}

// benchRound is how many alternated pairs make one round of
// BenchmarkRedisAcquireReleaseVsSetNX.
const benchRound = 500

// The Redis provider's uncontended acquire + release (two scripts, two
// round trips, plus the lease's bookkeeping) against the usual Redis lock:
// one SET key value NX PX, a single round trip, so the floor is 2. Both
// alternate on one client, so load elsewhere hits them alike. Every
// benchRound iterations make a round with its own ratio of median
// latencies (medians: on a shared machine one descheduled call moves a
// round's mean by more than the scripts cost); the benchmark reports the
// minimum, median and maximum ratio over the rounds. Run with
//
//	go test -run '^$' -bench RedisAcquireReleaseVsSetNX -benchtime 10000x ./internal/lock
func BenchmarkRedisAcquireReleaseVsSetNX(b *testing.B) {
	ctx := context.Background()
	prefix := testkit.RedisPrefix(b)
	rdb := testkit.RedisClient(b)
	r, err := NewRedis(rdb, prefix, "bench", nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(r.Close)
	pair := func() {
		l, err := r.TryAcquire(ctx, benchKey, 0, 30*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
	// Every SET takes a key of its own, so each one writes as a lock
	// acquire does; they expire after a second.
	n := 0
	setNX := func() {
		n++
		ok, err := rdb.SetNX(ctx, prefix+"setnx:"+strconv.Itoa(n), "owner", time.Second).Result()
		if err != nil || !ok {
			b.Fatalf("SET NX PX = %v, %v", ok, err)
		}
	}
	pair() // loads the scripts
	setNX()
	var ratios []float64
	var pairs, sets, allPairs, allSets []time.Duration
	for i := 0; b.Loop(); i++ {
		for j := range 2 {
			start := time.Now()
			if (i+j)%2 == 0 {
				pair()
				pairs = append(pairs, time.Since(start))
			} else {
				setNX()
				sets = append(sets, time.Since(start))
			}
		}
		if len(pairs) == benchRound {
			ratios = append(ratios, benchMedianUS(pairs)/benchMedianUS(sets))
			allPairs, allSets = append(allPairs, pairs...), append(allSets, sets...)
			pairs, sets = pairs[:0:0], sets[:0:0]
		}
	}
	if len(ratios) == 0 {
		b.Fatalf("fewer than %d iterations: no round to report (use -benchtime %dx or more)", benchRound, benchRound)
	}
	slices.Sort(ratios)
	b.ReportMetric(benchMedianUS(allPairs), "pair-median-us")
	b.ReportMetric(benchMedianUS(allSets), "setnx-median-us")
	b.ReportMetric(ratios[0], "ratio-min")
	b.ReportMetric(ratios[len(ratios)/2], "ratio-median")
	b.ReportMetric(ratios[len(ratios)-1], "ratio-max")
	b.Logf("acquire+release / SET NX PX over %d rounds of %d: min %.2f, median %.2f, max %.2f (medians %.0fµs and %.0fµs)",
		len(ratios), benchRound, ratios[0], ratios[len(ratios)/2], ratios[len(ratios)-1], benchMedianUS(allPairs), benchMedianUS(allSets))
}
