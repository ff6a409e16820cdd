package lock

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

func newAdapter(t *testing.T, l Locker, ttl time.Duration) (*GocronLocker, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := WithMetrics(l, reg)
	if err != nil {
		t.Fatal(err)
	}
	log := new(testkit.LogBuffer).Logger()
	g, err := NewGocronLocker(m, GocronConfig{TTL: func(string) time.Duration { return ttl }}, reg, log)
	if err != nil {
		t.Fatal(err)
	}
	return g, reg
}

func newScheduler(t *testing.T, g *GocronLocker) gocron.Scheduler {
	t.Helper()
	s, err := gocron.NewScheduler(gocron.WithDistributedLocker(g), gocron.WithStopTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Two schedulers (two replicas, each with its own provider and pool) run
// the same job; the runs never overlap, each sees its own lease through the
// adapter, and the fencing tokens grow from run to run.
func TestGocronTwoSchedulers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	const job = "tick"
	var (
		running atomic.Int32
		mu      sync.Mutex
		tokens  []int64
		regs    []*prometheus.Registry
		scheds  []gocron.Scheduler
	)
	for range 2 {
		g, reg := newAdapter(t, newPostgres(t, db, nil), 10*time.Second)
		regs = append(regs, reg)
		s := newScheduler(t, g)
		_, err := s.NewJob(gocron.DurationJob(20*time.Millisecond), gocron.NewTask(func() {
			lease, ok := g.Lease(job)
			if !ok {
				t.Error("job runs without a lease recorded by the adapter")
				return
			}
			if lease.Key() != "job:"+job {
				t.Errorf("lease key %q, want %q", lease.Key(), "job:"+job)
			}
			if n := running.Add(1); n != 1 {
				t.Errorf("%d runs at once", n)
			}
			time.Sleep(5 * time.Millisecond) // the job's work
			mu.Lock()
			tokens = append(tokens, lease.Token())
			mu.Unlock()
			running.Add(-1)
		}), gocron.WithName(job), gocron.WithSingletonMode(gocron.LimitModeReschedule))
		if err != nil {
			t.Fatal(err)
		}
		scheds = append(scheds, s)
	}
	for _, s := range scheds {
		s.Start()
	}
	testkit.Eventually(t, 30*time.Second, "20 runs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(tokens) >= 20
	})
	for _, s := range scheds {
		if err := s.Shutdown(); err != nil {
			t.Error(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("run %d token %d after %d", i, tokens[i], tokens[i-1])
		}
	}
	for i, reg := range regs {
		if got := metricValue(t, reg, "lock_unlock_errors_total"); got != 0 {
			t.Errorf("replica %d: lock_unlock_errors_total = %v, want 0", i, got)
		}
	}
}

// A run that outlives its lease gets ErrLeaseExpired from Unlock; gocron
// drops that error, so the adapter counts it.
func TestGocronUnlockErrorsCounted(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	g, reg := newAdapter(t, newPostgres(t, db, nil, WithoutHeartbeat()), 300*time.Millisecond)
	s := newScheduler(t, g)
	_, err := s.NewJob(gocron.OneTimeJob(gocron.OneTimeJobStartImmediately()), gocron.NewTask(func() {
		lease, ok := g.Lease("slow")
		if !ok {
			t.Error("no lease")
			return
		}
		select { // outlive the lease
		case <-lease.Lost():
		case <-time.After(10 * time.Second):
			t.Error("lease never ran out")
		}
	}), gocron.WithName("slow"))
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	defer s.Shutdown()
	testkit.Eventually(t, 15*time.Second, "lock_unlock_errors_total = 1", func() bool {
		return metricValue(t, reg, "lock_unlock_errors_total") == 1
	})
	if got := metricValue(t, reg, "lock_lease_expired_total"); got != 1 {
		t.Errorf("lock_lease_expired_total = %v, want 1", got)
	}
	if _, ok := g.Lease("slow"); ok {
		t.Error("adapter still records the lease of a finished run")
	}
}

// Shutdown cancels the job's context before gocron unlocks with it; the
// lease is released anyway.
func TestGocronUnlockAfterShutdownCancel(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	g, reg := newAdapter(t, newPostgres(t, db, nil), time.Minute)
	s := newScheduler(t, g)
	started := make(chan struct{})
	_, err := s.NewJob(gocron.OneTimeJob(gocron.OneTimeJobStartImmediately()), gocron.NewTask(func(ctx context.Context) {
		close(started)
		<-ctx.Done()
	}), gocron.WithName("long"))
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	waitClosed(t, started, 10*time.Second, "job start")
	if err := s.Shutdown(); err != nil {
		t.Fatal(err)
	}
	other := newPostgres(t, db, nil)
	testkit.Eventually(t, 10*time.Second, "lease released after shutdown", func() bool {
		l, err := other.TryAcquire(testCtx(t), JobKey("long"), 0, time.Second)
		if err != nil {
			return false
		}
		_ = l.Release(testCtx(t))
		return true
	})
	if got := metricValue(t, reg, "lock_unlock_errors_total"); got != 0 {
		t.Errorf("lock_unlock_errors_total = %v, want 0", got)
	}
	if got := metricValue(t, reg, "lock_held"); got != 0 {
		t.Errorf("lock_held = %v, want 0", got)
	}
}

// Unlock called directly with a cancelled context still releases, and a
// held job key makes Lock fail with a timeout so gocron skips the run.
func TestGocronLockDirect(t *testing.T) {
	db := pgtest.New(t)
	a, _ := newAdapter(t, newPostgres(t, db, nil), time.Minute)
	b, _ := newAdapter(t, newPostgres(t, db, nil), time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	lk, err := a.Lock(ctx, "j")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Lock(context.Background(), "j"); !IsTimeout(err) {
		t.Fatalf("second replica's Lock = %v, want a timeout", err)
	}
	if _, ok := b.Lease("j"); ok {
		t.Error("replica without the lease records one")
	}
	cancel()
	if err := lk.Unlock(ctx); err != nil {
		t.Fatalf("Unlock with a cancelled context = %v", err)
	}
	lk2, err := b.Lock(context.Background(), "j")
	if err != nil {
		t.Fatalf("Lock after release: %v", err)
	}
	if err := lk2.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := lk2.Unlock(context.Background()); err != nil {
		t.Errorf("second Unlock = %v, want nil", err)
	}
}

// Wait is asked on every Lock, so a caller can skip the wait on one
// attempt (a probe) and wait on the next.
func TestGocronWaitPerAttempt(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	a, _ := newAdapter(t, newPostgres(t, db, nil), time.Minute)
	parked := make(chan struct{}, 1)
	pg := newPostgres(t, db, nil, withWaitHook(func(string) {
		select {
		case parked <- struct{}{}:
		default:
		}
	}))
	var wait atomic.Int64
	b, err := NewGocronLocker(pg, GocronConfig{
		Wait: func(job string) time.Duration {
			if job != "j" {
				t.Errorf("Wait asked for %q", job)
			}
			return time.Duration(wait.Load())
		},
		TTL: func(string) time.Duration { return time.Minute },
	}, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	held, err := a.Lock(testCtx(t), "j")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Lock(testCtx(t), "j"); !IsTimeout(err) {
		t.Fatalf("Lock with no wait on a held key = %v, want a timeout", err)
	}
	if len(parked) != 0 {
		t.Fatal("Lock with no wait went to sleep")
	}
	wait.Store(int64(10 * time.Second))
	got := make(chan error, 1)
	go func() {
		lk, err := b.Lock(testCtx(t), "j")
		if err == nil {
			err = lk.Unlock(context.Background())
		}
		got <- err
	}()
	waitClosed(t, parked, 10*time.Second, "the second Lock to wait")
	if err := held.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("Lock that waited for the release = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Lock still waiting after the release")
	}
}
