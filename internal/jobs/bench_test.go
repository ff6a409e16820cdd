package jobs

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/pgtest"
)

// BenchmarkRunOverhead measures what the scheduler adds around one run of a
// no-op job with the PostgreSQL lock provider: acquire (through the gate and
// the gocron adapter), state check, start and end writes, release. Compare, in the same run, with
// BenchmarkBaselineRoundTrip (one trivial statement) and
// BenchmarkBaselineCommit (one single-row write transaction): three of the
// five statements wait for a WAL flush (the release does not), so commits
// dominate.
func BenchmarkRunOverhead(b *testing.B) {
	db := pgtest.New(b)
	pg, err := lock.NewPostgres(db.Pool, "bench", nil)
	if err != nil {
		b.Fatal(err)
	}
	defer pg.Close()
	s, err := New(Options{Pool: db.Pool, Locker: pg, InstanceID: "bench"},
		Spec{Job: Func("noop", func(context.Context) error { return nil }), Delay: time.Microsecond})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = s.gs.Shutdown() }()
	// Drive attempts the way gocron's executor does (Lock, task, Unlock)
	// instead of through its timer, so the figure is the per-run cost and
	// not the tick period.
	ctx := context.Background()
	s.base, s.cancelBase = context.WithCancelCause(ctx)
	e := s.entries[0]
	if err := s.st.register(ctx, e.name, e.spec.Delay); err != nil {
		b.Fatal(err)
	}
	g := gate{s}
	n := 0
	for b.Loop() {
		lk, err := g.Lock(ctx, e.name)
		if err != nil {
			b.Fatal(err)
		}
		s.attempt(e)
		if err := lk.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
		n++
	}
	b.StopTimer()
	// Every attempt must have been a full run, or the figure means nothing.
	if got := testutil.ToFloat64(s.m.runs.WithLabelValues("noop", OutcomeSuccess)); got != float64(n) {
		b.Fatalf("%v successful runs for %d attempts", got, n)
	}
}

func BenchmarkBaselineRoundTrip(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	for b.Loop() {
		if _, err := db.Pool.Exec(ctx, "SELECT 1"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBaselineCommit is one single-row write transaction, the unit
// that bounds BenchmarkRunOverhead (with fsync on, each commit waits for
// the WAL flush).
func BenchmarkBaselineCommit(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	st := store{db.Pool}
	if err := st.register(ctx, "x", time.Second); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := db.Pool.Exec(ctx, "UPDATE job_state SET updated_at = now() WHERE name = 'x'"); err != nil {
			b.Fatal(err)
		}
	}
}
