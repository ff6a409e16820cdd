package lock

import (
	"context"
	"slices"
	"testing"
	"time"

	"worker/internal/pgtest"
)

// Run with: go test -run '^$' -bench . -benchtime 2000x -count 5 ./internal/lock
// and compare AcquireRelease with BaselineUpdateReturning from the same run.

// One uncontended acquire + release: two single statements.
func BenchmarkPostgresAcquireRelease(b *testing.B) {
	ctx := context.Background()
	p := newPostgres(b, pgtest.New(b), nil)
	for b.Loop() {
		l, err := p.TryAcquire(ctx, "bench", 0, 30*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// The floor: one single-row UPDATE ... RETURNING commit on an equal pool.
func BenchmarkBaselineUpdateReturning(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.New(b).NewPool(b, 0)
	_, err := pool.Exec(ctx, `CREATE TABLE bench_counter (key text PRIMARY KEY, n bigint NOT NULL) WITH (fillfactor = 50);
	                          INSERT INTO bench_counter VALUES ('bench', 0)`)
	if err != nil {
		b.Fatal(err)
	}
	var n int64
	for b.Loop() {
		if err := pool.QueryRow(ctx, `UPDATE bench_counter SET n = n + 1 WHERE key = $1 RETURNING n`, "bench").Scan(&n); err != nil {
			b.Fatal(err)
		}
	}
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
