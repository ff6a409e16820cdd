package jobs

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

func TestFixedDelayNoOverlap(t *testing.T) {
	db := pgtest.New(t)
	const delay = 500 * time.Millisecond
	var (
		mu      sync.Mutex
		spans   [][2]time.Time
		tokens  []int64
		running atomic.Int32
		overlap atomic.Bool
	)
	job := Func("tick", func(ctx context.Context) error {
		if running.Add(1) > 1 {
			overlap.Store(true)
		}
		defer running.Add(-1)
		start := time.Now()
		tok, _ := FencingToken(ctx)
		select {
		case <-time.After(300 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		mu.Lock()
		defer mu.Unlock()
		spans = append(spans, [2]time.Time{start, time.Now()})
		tokens = append(tokens, tok)
		return nil
	})
	r := startReplica(t, Options{Pool: db.Pool, Locker: inProcess(), InstanceID: "replica-a"}, Spec{Job: job, Delay: delay})
	testkit.Eventually(t, 20*time.Second, "5 runs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(spans) >= 5
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}

	mu.Lock()
	defer mu.Unlock()
	if overlap.Load() {
		t.Fatal("two runs of the job overlapped")
	}
	for i := 1; i < len(spans); i++ {
		gap := spans[i][0].Sub(spans[i-1][1])
		if gap < delay {
			t.Errorf("run %d started %s after run %d finished; want at least %s", i, gap, i-1, delay)
		}
		if gap > delay+time.Second {
			t.Errorf("run %d started %s after run %d finished; want at most %s", i, gap, i-1, delay+time.Second)
		}
		if tokens[i] <= tokens[i-1] {
			t.Errorf("fencing tokens not increasing: %v", tokens)
		}
	}
	if got := runs(t, r.reg, "tick", OutcomeSuccess); got != float64(len(spans)) {
		t.Errorf("job_runs_total{outcome=success} = %v, want %d", got, len(spans))
	}
	if got := metric(t, r.reg, "job_duration_seconds", map[string]string{"job_name": "tick"}); got != float64(len(spans)) {
		t.Errorf("job_duration_seconds count = %v, want %d", got, len(spans))
	}
	if got := metric(t, r.reg, "job_last_success_timestamp_seconds", map[string]string{"job_name": "tick"}); got < float64(spans[0][0].Unix()) {
		t.Errorf("job_last_success_timestamp_seconds = %v", got)
	}

	lines := r.log.Lines(t, "job run finished")
	if len(lines) != len(spans) {
		t.Fatalf("%d run-end log lines for %d runs", len(lines), len(spans))
	}
	for i, l := range lines {
		if _, err := uuid.Parse(l["run_id"].(string)); err != nil {
			t.Errorf("run_id %v: %v", l["run_id"], err)
		}
		if l["job"] != "tick" || l["outcome"] != OutcomeSuccess || num(l["duration_ms"]) < 300 ||
			num(l["fencing_token"]) != tokens[i] || l["error.code"] != nil {
			t.Errorf("log line %v", l)
		}
	}

	st := state(t, db.Pool, "tick")
	if st.LastOutcome != OutcomeSuccess || st.LastInstance != "replica-a" || st.LastToken != tokens[len(tokens)-1] ||
		st.Delay != delay || !st.NextDueAt.Equal(st.LastFinishedAt.Add(delay)) || st.LastStartedAt.After(st.LastFinishedAt) {
		t.Errorf("job_state = %+v", st)
	}
}

func TestTimeoutAndPanic(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	slow := Func("slow", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
	boom := Func("boom", func(ctx context.Context) error { panic("kaboom") })
	r := startReplica(t, Options{Pool: db.Pool, Locker: inProcess()},
		Spec{Job: slow, Delay: time.Hour, Timeout: 200 * time.Millisecond},
		Spec{Job: boom, Delay: time.Hour})
	testkit.Eventually(t, 10*time.Second, "a timeout and a failure", func() bool {
		return runs(t, r.reg, "slow", OutcomeTimeout) == 1 && runs(t, r.reg, "boom", OutcomeFailure) == 1
	})
	for _, l := range r.log.Lines(t, "job run finished") {
		switch l["job"] {
		case "slow":
			if l["outcome"] != OutcomeTimeout || l["error.code"] != obs.CodeJobTimeout || l["level"] != "ERROR" {
				t.Errorf("timeout line %v", l)
			}
		case "boom":
			stack, _ := l["stack"].(string)
			if l["outcome"] != OutcomeFailure || l["error"] != "panic: kaboom" || !strings.Contains(stack, "TestTimeoutAndPanic") {
				t.Errorf("panic line %v", l)
			}
		}
	}
	testkit.Eventually(t, 5*time.Second, "both ends recorded", func() bool {
		return state(t, db.Pool, "slow").LastOutcome == OutcomeTimeout && state(t, db.Pool, "boom").LastOutcome == OutcomeFailure
	})
	if st := state(t, db.Pool, "boom"); st.LastError != "panic: kaboom" {
		t.Errorf("boom last_error = %q", st.LastError)
	}
}

func TestRejectedWhenExecutorFull(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	hog := newBlocker("hog")
	var quickRuns atomic.Int32
	quick := Func("quick", func(context.Context) error { quickRuns.Add(1); return nil })
	r := startReplica(t, Options{Pool: db.Pool, Locker: inProcess(), MaxConcurrent: 1},
		Spec{Job: hog, Delay: time.Hour},
		Spec{Job: quick, Delay: 100 * time.Millisecond})
	<-hog.started
	testkit.Eventually(t, 10*time.Second, "a rejected run", func() bool { return runs(t, r.reg, "quick", OutcomeRejected) >= 1 })
	if got := metric(t, r.reg, "executor_rejected_total", nil); got < 1 {
		t.Errorf("executor_rejected_total = %v", got)
	}
	if got := metric(t, r.reg, "executor_saturation", nil); got != 1 {
		t.Errorf("executor_saturation = %v while the only slot is taken, want 1", got)
	}
	// The metric is counted just before the line is written: poll for it.
	testkit.Eventually(t, 5*time.Second, "a rejection log line for quick", func() bool {
		found := false
		for _, l := range r.log.Lines(t, "job run rejected: executor at capacity") {
			// hog itself may have been refused once if quick held the slot
			// when both started.
			found = found || l["job"] == "quick"
			if l["error.code"] != obs.CodeJobExecutorRejected || l["level"] != "ERROR" {
				t.Errorf("rejection line %v", l)
			}
		}
		return found
	})

	before := quickRuns.Load()
	close(hog.release)
	testkit.Eventually(t, 10*time.Second, "quick to run once the slot is free", func() bool { return quickRuns.Load() > before })
	testkit.Eventually(t, 5*time.Second, "saturation back to 0", func() bool { return metric(t, r.reg, "executor_saturation", nil) == 0 })
}

func TestLeaseLostCancelsRun(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	pg, err := lock.NewPostgres(db.Pool, "a", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	b := newBlocker("hold")
	r := startReplica(t, Options{Pool: db.Pool, Locker: pg},
		Spec{Job: b, Delay: time.Hour, LeaseTTL: time.Second, Timeout: time.Minute})
	var tok int64
	select {
	case tok = <-b.started:
	case <-time.After(10 * time.Second):
		t.Fatal("job did not start")
	}
	// Take the lease over behind the holder's back, as a replica would
	// after the holder's lease expired: another owner, a newer token. The
	// holder's next heartbeat finds it gone.
	tag, err := db.Pool.Exec(context.Background(), `
UPDATE worker_lock SET owner = 'thief', token = nextval('worker_lock_token_seq'),
    expires_at = clock_timestamp() + interval '1 hour' WHERE key = 'job:hold'`)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("steal lease: %v, %d rows", err, tag.RowsAffected())
	}
	testkit.Eventually(t, 10*time.Second, "lease_lost", func() bool { return runs(t, r.reg, "hold", OutcomeLeaseLost) == 1 })
	testkit.Eventually(t, 5*time.Second, "the end recorded", func() bool { return state(t, db.Pool, "hold").LastOutcome == OutcomeLeaseLost })
	if st := state(t, db.Pool, "hold"); st.LastToken != tok {
		t.Errorf("job_state token %d, want %d", st.LastToken, tok)
	}
	lines := r.log.Lines(t, "job run finished")
	if len(lines) != 1 || lines[0]["outcome"] != OutcomeLeaseLost || num(lines[0]["fencing_token"]) != tok {
		t.Errorf("run-end lines %v", lines)
	}
	if got := runs(t, r.reg, "hold", OutcomeSuccess); got != 0 {
		t.Errorf("success = %v", got)
	}
	// gocron drops the error of the release that follows (the lease is
	// gone); the adapter counts it.
	testkit.Eventually(t, 5*time.Second, "the failed release counted", func() bool {
		return metric(t, r.reg, "lock_unlock_errors_total", nil) == 1
	})
}

// While this replica knows the job cannot be due, gocron's lock call is
// answered locally: one lease acquisition per run, none per tick.
func TestNotDueCostsNoLockStatement(t *testing.T) {
	db := pgtest.New(t)
	const delay = 2 * time.Second // four ticks of 500ms per rest
	lockReg := prometheus.NewRegistry()
	locker, err := lock.WithMetrics(inProcess(), lockReg)
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	r := startReplica(t, Options{Pool: db.Pool, Locker: locker},
		Spec{Job: Func("rests", func(context.Context) error { n.Add(1); return nil }), Delay: delay})
	testkit.Eventually(t, 20*time.Second, "3 runs", func() bool { return n.Load() >= 3 })
	if err := r.s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	var acquisitions float64
	for _, o := range []string{lock.OutcomeAcquired, lock.OutcomeTimeout, lock.OutcomeError} {
		acquisitions += metric(t, lockReg, "lock_acquisition_total", map[string]string{"outcome": o, "provider": "inprocess"})
	}
	done := runs(t, r.reg, "rests", OutcomeSuccess)
	t.Logf("%v lease acquisitions for %v runs with delay %s", acquisitions, done, delay)
	// Shutdown may have interrupted one attempt that held the lease while
	// waiting out the last moments before the due time.
	if acquisitions < done || acquisitions > done+1 {
		t.Errorf("%v lease acquisitions for %v runs; want one per run", acquisitions, done)
	}
	if got := runs(t, r.reg, "rests", OutcomeSkippedNotDue); got != 0 {
		t.Errorf("skipped_not_due = %v; the replica should not have looked before the due time", got)
	}
}

func TestShutdownWaitsThenCancels(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	locker := inProcess()
	finishes, cancelled := newBlocker("finishes"), newBlocker("cancelled")
	r := startReplica(t, Options{Pool: db.Pool, Locker: locker},
		Spec{Job: finishes, Delay: time.Hour}, Spec{Job: cancelled, Delay: time.Hour})
	<-finishes.started
	<-cancelled.started

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.s.Shutdown(ctx) }()
	// A job that ends within the budget ends normally.
	close(finishes.release)
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if got := runs(t, r.reg, "finishes", OutcomeSuccess); got != 1 {
		t.Errorf("finishes: success = %v", got)
	}
	if got := runs(t, r.reg, "cancelled", OutcomeCancelled); got != 1 {
		t.Errorf("cancelled: cancelled = %v", got)
	}
	if st := state(t, db.Pool, "cancelled"); st.LastOutcome != OutcomeCancelled {
		t.Errorf("cancelled job_state = %+v", st)
	}
	// Both leases were handed back: a new holder gets them at once.
	for _, key := range []string{"job:finishes", "job:cancelled"} {
		l, err := locker.TryAcquire(context.Background(), key, 0, time.Second)
		if err != nil {
			t.Fatalf("%s still held after Shutdown: %v", key, err)
		}
		_ = l.Release(context.Background())
	}
}

func TestShutdownStopsNewRuns(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var n atomic.Int32
	job := Func("often", func(context.Context) error { n.Add(1); return nil })
	r := startReplica(t, Options{Pool: db.Pool, Locker: inProcess()}, Spec{Job: job, Delay: 50 * time.Millisecond})
	testkit.Eventually(t, 10*time.Second, "a few runs", func() bool { return n.Load() >= 2 })
	if err := r.s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	after := n.Load()
	// Absence can only be shown by waiting: several periods pass with no run.
	time.Sleep(300 * time.Millisecond)
	if n.Load() != after {
		t.Fatalf("%d runs started after Shutdown returned", n.Load()-after)
	}
}

func TestMetricsInitializedAtZero(t *testing.T) {
	db := pgtest.New(t)
	r := startReplica(t, Options{Pool: db.Pool, Locker: inProcess()},
		Spec{Job: Func("a", func(context.Context) error { return nil }), Delay: time.Hour, InitialDelay: time.Hour},
		Spec{Job: Func("b", func(context.Context) error { return nil }), Delay: time.Hour, InitialDelay: time.Hour})
	for _, job := range []string{"a", "b"} {
		for _, o := range outcomes {
			if got := runs(t, r.reg, job, o); got != 0 {
				t.Errorf("job_runs_total{job_name=%q,outcome=%q} = %v, want 0", job, o, got)
			}
		}
		for _, name := range []string{"job_duration_seconds", "job_last_success_timestamp_seconds", "job_running"} {
			if got := metric(t, r.reg, name, map[string]string{"job_name": job}); got != 0 {
				t.Errorf("%s{job_name=%q} = %v, want 0", name, job, got)
			}
		}
		if got := metric(t, r.reg, "job_delay_seconds", map[string]string{"job_name": job}); got != 3600 {
			t.Errorf("job_delay_seconds{job_name=%q} = %v, want the job's delay, 3600", job, got)
		}
	}
	for _, name := range []string{"executor_rejected_total", "executor_saturation"} {
		if got := metric(t, r.reg, name, nil); got != 0 {
			t.Errorf("%s = %v, want 0", name, got)
		}
	}
}

func TestListBeforeFirstRun(t *testing.T) {
	db := pgtest.New(t)
	startReplica(t, Options{Pool: db.Pool, Locker: inProcess()},
		Spec{Job: Func("later", func(context.Context) error { return nil }), Delay: 90 * time.Second, InitialDelay: time.Hour})
	st := state(t, db.Pool, "later")
	if st.Delay != 90*time.Second || st.LastOutcome != "" || !st.LastStartedAt.IsZero() || st.NextDueAt.IsZero() {
		t.Fatalf("status = %+v", st)
	}
	var buf bytes.Buffer
	list, err := List(context.Background(), db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if err := PrintList(&buf, list); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{"JOB", "NEXT DUE", "later", "1m30s", "1 job(s)"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestAbandonedRunIsClosedByNextHolder(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	st := store{db.Pool}
	if err := st.register(ctx, "j", time.Second); err != nil {
		t.Fatal(err)
	}
	if ok, err := st.start(ctx, "j", time.Second, "dead-replica", 5, uuid.NewString()); err != nil || !ok {
		t.Fatalf("start: %v %v", ok, err)
	}
	wait, prev, err := st.due(ctx, "j", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if prev == nil || prev.Instance != "dead-replica" || prev.Token != 5 || wait != time.Second {
		t.Fatalf("due = %s, %+v", wait, prev)
	}
	s := state(t, db.Pool, "j")
	if s.LastOutcome != "abandoned" || s.LastFinishedAt.IsZero() || !s.NextDueAt.Equal(s.LastFinishedAt.Add(time.Second)) {
		t.Fatalf("state = %+v", s)
	}
	// The dead run's late write (a zombie) is fenced out once a newer run
	// started.
	if ok, err := st.start(ctx, "j", 0, "b", 6, uuid.NewString()); err != nil || !ok {
		t.Fatalf("start: %v %v", ok, err)
	}
	if ok, err := st.finish(ctx, "j", time.Second, 5, OutcomeSuccess, ""); err != nil || ok {
		t.Fatalf("stale finish applied: %v %v", ok, err)
	}
}

func TestNewRejectsBadSpecs(t *testing.T) {
	db := pgtest.New(t)
	job := Func("x", func(context.Context) error { return nil })
	opts := Options{Pool: db.Pool, Locker: inProcess(), InstanceID: "i"}
	for name, specs := range map[string][]Spec{
		"duplicate": {{Job: job, Delay: time.Second}, {Job: job, Delay: time.Second}},
		"no delay":  {{Job: job}},
		"no job":    {{Delay: time.Second}},
		"bad name":  {{Job: Func("a b", nil), Delay: time.Second}},
		"negative":  {{Job: job, Delay: time.Second, Timeout: -1}},
	} {
		if _, err := New(opts, specs...); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := New(Options{Pool: db.Pool, Locker: inProcess()}, Spec{Job: job, Delay: time.Second}); err == nil {
		t.Error("missing InstanceID accepted")
	}
}

// slowAcquire holds the first TryAcquire until released, so Shutdown can
// begin while gocron's lock call is in flight.
type slowAcquire struct {
	lock.Locker
	entered, release chan struct{}
	once             atomic.Bool
}

func (l *slowAcquire) TryAcquire(ctx context.Context, key string, wait, ttl time.Duration) (lock.Lease, error) {
	if l.once.CompareAndSwap(false, true) {
		close(l.entered)
		<-l.release
	}
	return l.Locker.TryAcquire(ctx, key, wait, ttl)
}

// docs/jobs.md, Shutdown step 1: "No attempt starts from then on". An
// attempt whose lease arrives after Shutdown began must not start a run.
func TestNoRunStartsAfterShutdownBegan(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	l := &slowAcquire{Locker: inProcess(), entered: make(chan struct{}), release: make(chan struct{})}
	var ran atomic.Int32
	r := startReplica(t, Options{Pool: db.Pool, Locker: l},
		Spec{Job: Func("late", func(context.Context) error { ran.Add(1); return nil }), Delay: time.Hour})
	<-l.entered
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- r.s.Shutdown(ctx)
	}()
	testkit.Eventually(t, 2*time.Second, "shutdown to begin", func() bool {
		r.s.mu.Lock()
		defer r.s.mu.Unlock()
		return r.s.stopping
	})
	close(l.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := ran.Load(); n != 0 {
		t.Fatalf("%d run(s) started after Shutdown began", n)
	}
}

// One failed end write (a database blip right after the run) must not
// double the rest: the run's row stays "running", and the next attempt marks
// it abandoned and counts the delay from then. Single instance, so only
// this replica can notice; it looked again only delay - period later, so
// the next run came about 2 x delay after the previous one finished.
func TestFailedEndWriteKeepsCadence(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
CREATE SEQUENCE fail_once;
CREATE FUNCTION fail_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  -- nextval survives the rollback the exception causes (a DELETE would not,
  -- and every end write would fail), so only the first end write fails.
  IF OLD.last_outcome = 'running' AND NEW.last_outcome = 'success' THEN
    IF nextval('fail_once') = 1 THEN RAISE EXCEPTION 'injected: end write fails once'; END IF;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_end BEFORE UPDATE ON job_state FOR EACH ROW EXECUTE FUNCTION fail_end();`); err != nil {
		t.Fatal(err)
	}
	const delay = 2 * time.Second
	var mu sync.Mutex
	var starts, ends []time.Time
	job := Func("blip", func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		starts = append(starts, time.Now())
		ends = append(ends, time.Now())
		return nil
	})
	startReplica(t, Options{Pool: db.Pool, Locker: inProcess()}, Spec{Job: job, Delay: delay})
	testkit.Eventually(t, 15*time.Second, "two runs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(starts) >= 2
	})
	mu.Lock()
	defer mu.Unlock()
	// Fixed: about delay + period (2.5s). Unfixed: delay - period + delay
	// (3.5s and more), so the bound must sit well below 3.5s.
	if gap := starts[1].Sub(ends[0]); gap > delay+time.Second {
		t.Fatalf("after a failed end write the next run started %s after the previous one ended; want at most delay (%s) + about 1s",
			gap.Round(time.Millisecond), delay)
	}
}
