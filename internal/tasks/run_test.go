package tasks

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/riverqueue/river"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// A sql task enqueued with the SQL function runs on River: its statement
// gets the args, and its effect and its completion commit together.
func TestRiverRunsTasksEnqueuedBySQL(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(t.Context(), "CREATE TABLE receipt (order_id int PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "record-receipt", Type: tasksconfig.TypeSQL,
		SQL: "INSERT INTO receipt VALUES (($1->>'order')::int)"})
	h := start(t, db, cfg, nil)
	id := enqueueSQL(t, db.Pool, "record-receipt", `{"order": 42}`, `{}`)
	waitState(t, db.Pool, id, "completed", 10*time.Second)
	var n int
	if err := db.Pool.QueryRow(t.Context(), "SELECT count(*) FROM receipt WHERE order_id = 42").Scan(&n); err != nil || n != 1 {
		t.Fatalf("receipt rows %d (%v), want 1", n, err)
	}
	if v := metric(t, h, "task_runs_total", map[string]string{"task_kind": "record-receipt", "outcome": OutcomeSuccess}); v != 1 {
		t.Fatalf("task_runs_total success = %v, want 1", v)
	}
}

// A task of a kind this replica does not know is left available, attempts
// untouched, for a replica that knows it; known kinds behind it still run.
func TestUnknownKindWaitsForAReplicaThatKnowsIt(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	start(t, db, testConfig(t, nil, tasksconfig.Kind{Name: "known", Type: tasksconfig.TypeSQL, SQL: "SELECT $1"}), nil)
	unknown := enqueueSQL(t, db.Pool, "added-in-next-release", `{}`, `{}`)
	known := enqueueSQL(t, db.Pool, "known", `{}`, `{}`)
	waitState(t, db.Pool, known, "completed", 10*time.Second)
	if r := rowOf(t, db.Pool, unknown); r.State != "available" || r.Attempt != 0 {
		t.Fatalf("unknown kind: state %s attempt %d, want available and 0", r.State, r.Attempt)
	}
}

type greetArgs struct {
	Name string `json:"name"`
}

func (greetArgs) Kind() string { return "greet" }

// greetWorker is a Go task kind; it logs through the logger the run's
// context carries.
type greetWorker struct {
	river.WorkerDefaults[greetArgs]
	done chan string
}

func (w *greetWorker) Work(ctx context.Context, job *river.Job[greetArgs]) error {
	obs.Logger(ctx).Info("greeting", "name", job.Args.Name)
	w.done <- job.Args.Name
	return nil
}

// A Go kind enqueued with Enqueue runs with the caller's context: every log
// line of the run carries request_id, traceparent, trace_id, correlation_id
// and tenant_id.
func TestGoKindRunsWithPropagatedContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	w := &greetWorker{done: make(chan string, 1)}
	h := start(t, db, testConfig(t, nil), func(r *Registry) error { return AddWorker(r, w) })

	ctx := WithMeta(t.Context(), Meta{RequestID: "req-1", Traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		CorrelationID: "corr-1", TenantID: "acme"})
	enqueueGo(t, ctx, db.Pool, "greet", `{"name": "ada"}`)
	select {
	case name := <-w.done:
		if name != "ada" {
			t.Fatalf("worker got %q", name)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Go task did not run")
	}
	var lines []map[string]any
	testkit.Eventually(t, 5*time.Second, "the run's result line", func() bool {
		lines = nil
		for _, l := range h.logs.Lines(t, "") {
			if l["task_kind"] == "greet" {
				lines = append(lines, l)
			}
		}
		return len(lines) >= 3 // started, greeting, succeeded
	})
	want := map[string]string{"request_id": "req-1", "trace_id": "0af7651916cd43dd8448eb211c80319c",
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "correlation_id": "corr-1", "tenant_id": "acme"}
	for _, l := range lines {
		for k, v := range want {
			if l[k] != v {
				t.Errorf("log line %v: %s = %v, want %q", l["msg"], k, l[k], v)
			}
		}
	}
}

// A task that keeps failing is retried with backoff, then dead-lettered
// (discarded): job_retry_total counts each retry, job_dlq_total the dead
// letter, and the log says JOB_DEAD_LETTER.
func TestFailingTaskIsRetriedThenDeadLettered(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var calls atomic.Int32
	var last atomic.Value // the last request's headers
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		last.Store(r.Header.Clone())
		w.WriteHeader(http.StatusInternalServerError) // the task's own failure, unlike 502 or 503
	}))
	t.Cleanup(srv.Close)
	h := start(t, db, testConfig(t, nil, tasksconfig.Kind{Name: "notify", Type: tasksconfig.TypeHTTP, URL: srv.URL}), nil)
	tp := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	id := enqueueSQL(t, db.Pool, "notify", `{}`, `{"traceparent": "`+tp+`"}`)

	row := waitState(t, db.Pool, id, "discarded", 20*time.Second)
	if row.Attempt != 3 || calls.Load() != 3 {
		t.Fatalf("attempt %d after %d calls, want 3 and 3", row.Attempt, calls.Load())
	}
	hdr := last.Load().(http.Header)
	for name, want := range map[string]string{"Traceparent": tp, "X-Task-Id": fmt.Sprint(id), "X-Task-tasksconfig.Kind": "notify",
		"X-Task-Attempt": "3", "Content-Type": "application/json"} {
		if got := hdr.Get(name); got != want {
			t.Errorf("the last request's %s: %q, want %q", name, got, want)
		}
	}
	testkit.Eventually(t, 5*time.Second, "metrics", func() bool {
		return metric(t, h, "job_retry_total", map[string]string{"job_name": "notify", "outcome": "scheduled"}) == 2 &&
			metric(t, h, "job_dlq_total", map[string]string{"job_name": "notify"}) == 1
	})
	dead := h.logs.Lines(t, "task dead-lettered")
	if len(dead) != 1 || dead[0]["error.code"] != obs.CodeJobDeadLetter || dead[0]["state"] != "discarded" || dead[0]["trace_id"] != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("dead-letter log lines: %v", dead)
	}
}

// A permanent error (a 4xx other than 408 and 429) dead-letters at once:
// cancelled, one attempt, no retry.
func TestPermanentErrorDeadLettersAtOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.WriteHeader(http.StatusUnprocessableEntity)
	}))
	t.Cleanup(srv.Close)
	h := start(t, db, testConfig(t, nil, tasksconfig.Kind{Name: "notify", Type: tasksconfig.TypeHTTP, URL: srv.URL}), nil)
	id := enqueueSQL(t, db.Pool, "notify", `{}`, `{}`)
	waitState(t, db.Pool, id, "cancelled", 10*time.Second)
	testkit.Eventually(t, 5*time.Second, "dead letter counted", func() bool {
		return metric(t, h, "job_dlq_total", map[string]string{"job_name": "notify"}) == 1
	})
	if calls.Load() != 1 || metric(t, h, "job_retry_total", map[string]string{"job_name": "notify", "outcome": "scheduled"}) != 0 {
		t.Fatalf("%d calls, want 1 and no retry", calls.Load())
	}
	if l := h.logs.Lines(t, "task dead-lettered"); len(l) != 1 || l[0]["state"] != "cancelled" {
		t.Fatalf("dead-letter log lines: %v", l)
	}
}

// 429 with Retry-After says the endpoint is unavailable: the task snoozes
// without spending an attempt, for as long as asked rather than the (here
// much shorter) probe backoff, and then runs.
func TestRetryAfterIsHonoured(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "notify", Type: tasksconfig.TypeHTTP, URL: srv.URL})
	cfg.ProbeBackoffMax = 100 * time.Millisecond
	start(t, db, cfg, nil)
	id := enqueueSQL(t, db.Pool, "notify", `{}`, `{}`)
	var wait time.Duration
	testkit.Eventually(t, 10*time.Second, "the task snoozed", func() bool {
		err := db.Pool.QueryRow(t.Context(), `SELECT extract(epoch FROM scheduled_at - attempted_at) * interval '1s' FROM river_job
			WHERE id = $1 AND (metadata->>'snoozes')::int = 1`, id).Scan(&wait)
		return err == nil
	})
	if wait < 1500*time.Millisecond {
		t.Fatalf("snoozed %s after the attempt, want about 2s (Retry-After)", wait)
	}
	r := waitState(t, db.Pool, id, "completed", 10*time.Second)
	if r.Errors != 0 || r.Attempt != 1 || calls.Load() != 2 {
		t.Fatalf("%d errors, attempt %d, %d calls; want 0, 1 and 2: a snooze spends no attempt", r.Errors, r.Attempt, calls.Load())
	}
}

// A run past its kind's timeout is cancelled, logged with JOB_TIMEOUT and
// retried.
func TestTimeoutCancelsTheRun(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "slow", Type: tasksconfig.TypeSQL, SQL: "SELECT pg_sleep(30), $1::jsonb", Timeout: 200 * time.Millisecond, MaxAttempts: 2})
	h := start(t, db, cfg, nil)
	id := enqueueSQL(t, db.Pool, "slow", `{}`, `{}`)
	// The statement sleeps 30s; only the timeout ends both runs in time.
	waitState(t, db.Pool, id, "discarded", 20*time.Second)
	lines := h.logs.Lines(t, "task run timed out and was cancelled")
	if len(lines) != 2 || lines[0]["error.code"] != obs.CodeJobTimeout {
		t.Fatalf("timeout log lines: %v", lines)
	}
	if v := metric(t, h, "task_runs_total", map[string]string{"task_kind": "slow", "outcome": OutcomeTimeout}); v != 2 {
		t.Fatalf("task_runs_total timeout = %v, want 2", v)
	}
}

type blockArgs struct{}

func (blockArgs) Kind() string { return "block" }

// blockWorker records how many of its runs overlap, and holds each until
// released.
type blockWorker struct {
	river.WorkerDefaults[blockArgs]
	running, peak atomic.Int32
	release       chan struct{}
}

func (w *blockWorker) Work(ctx context.Context, _ *river.Job[blockArgs]) error {
	n := w.running.Add(1)
	defer w.running.Add(-1)
	for {
		p := w.peak.Load()
		if n <= p || w.peak.CompareAndSwap(p, n) {
			break
		}
	}
	select {
	case <-w.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// max_workers bounds the tasks of a queue running at once on a replica.
func TestMaxWorkersBoundsConcurrency(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	w := &blockWorker{release: make(chan struct{})}
	cfg := testConfig(t, map[string]tasksconfig.Queue{"default": queue(2, 100)})
	start(t, db, cfg, func(r *Registry) error { return AddWorker(r, w) })
	ids := make([]int64, 6)
	for i := range ids {
		ids[i] = enqueueGo(t, t.Context(), db.Pool, "block", `{}`)
	}
	testkit.Eventually(t, 10*time.Second, "two tasks running", func() bool { return w.running.Load() == 2 })
	go func() {
		for range 6 {
			w.release <- struct{}{}
		}
	}()
	for _, id := range ids {
		waitState(t, db.Pool, id, "completed", 10*time.Second)
	}
	if p := w.peak.Load(); p != 2 {
		t.Fatalf("peak concurrency %d, want 2 (max_workers)", p)
	}
}

// At shutdown, a task still running when the budget ends is cancelled
// (StopAndCancel) and handed back without using up its attempt; a later
// replica runs it.
func TestShutdownCancelsRunningTaskWhichRunsAgainLater(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(t.Context(), "CREATE TABLE done (id int)"); err != nil {
		t.Fatal(err)
	}
	// The first replica's statement outlasts the budget; the task's args
	// are then changed so the second replica's run is quick.
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "work", Type: tasksconfig.TypeSQL, MaxAttempts: 1,
		SQL: "INSERT INTO done SELECT 1 FROM pg_sleep(($1->>'sleep')::float8)"})
	h := start(t, db, cfg, nil)
	id := enqueueSQL(t, db.Pool, "work", `{"sleep": 30}`, `{}`)
	waitState(t, db.Pool, id, "running", 10*time.Second)

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	began := time.Now()
	if err := h.rt.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	t.Logf("shutdown took %s with a 300ms budget; the statement sleeps 30s", time.Since(began))
	r := rowOf(t, db.Pool, id)
	if r.State != "available" || r.Attempt != 0 {
		var e string
		_ = db.Pool.QueryRow(t.Context(), "SELECT errors::text FROM river_job WHERE id = $1", id).Scan(&e)
		t.Fatalf("after shutdown: state %s attempt %d, want available and 0 (no attempt used); errors %s", r.State, r.Attempt, e)
	}
	if l := h.logs.Lines(t, "task run interrupted by shutdown; it runs again later without using an attempt"); len(l) != 1 {
		t.Fatalf("interrupted log lines: %v", l)
	}

	if _, err := db.Pool.Exec(t.Context(), `UPDATE river_job SET args = '{"sleep": 0}' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	start(t, db, cfg, nil)
	waitState(t, db.Pool, id, "completed", 10*time.Second)
	var n int
	if err := db.Pool.QueryRow(t.Context(), "SELECT count(*) FROM done").Scan(&n); err != nil || n != 1 {
		t.Fatalf("effects %d (%v), want 1", n, err)
	}
}

// Known series exist at zero from the start, and tasks{queue,state} follows
// the table.
func TestMetricsStartAtZeroAndFollowTheTable(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := testConfig(t, map[string]tasksconfig.Queue{"mail": queue(1, 4)},
		tasksconfig.Kind{Name: "later", Type: tasksconfig.TypeGo, Queue: "mail"})
	h := start(t, db, cfg, func(r *Registry) error {
		return AddWorker(r, river.WorkFunc(func(context.Context, *river.Job[laterArgs]) error { return nil }))
	})
	for _, o := range outcomes {
		if v := metric(t, h, "task_runs_total", map[string]string{"task_kind": "later", "outcome": o}); v != 0 {
			t.Errorf("task_runs_total{later,%s} = %v", o, v)
		}
	}
	for _, name := range []string{"job_retry_total", "job_dlq_total"} {
		labels := map[string]string{"job_name": "later"}
		if name == "job_retry_total" {
			labels["outcome"] = "scheduled"
		}
		metric(t, h, name, labels)
	}
	for _, q := range []string{"default", "mail"} {
		metric(t, h, "task_queue_wait_seconds", map[string]string{"queue": q})
		for _, s := range states {
			metric(t, h, "tasks", map[string]string{"queue": q, "state": string(s)})
		}
	}
	// Scheduled for later: counted, not run.
	for range 2 {
		if _, err := db.Pool.Exec(t.Context(), "SELECT worker_enqueue('later', scheduled_at => now() + interval '1 hour')"); err != nil {
			t.Fatal(err)
		}
	}
	testkit.Eventually(t, 5*time.Second, "tasks{mail,scheduled} = 2", func() bool {
		return metric(t, h, "tasks", map[string]string{"queue": "mail", "state": "scheduled"}) == 2
	})
}

type laterArgs struct{}

func (laterArgs) Kind() string { return "later" }
