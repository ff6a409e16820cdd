package tasks

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// An endpoint that is down costs no task an attempt: tasks enqueued during
// the outage snooze, only probes reach the endpoint, one WARN says it is
// down and one INFO that it is back, with how many tasks waited; then
// every task runs, none with an error recorded.
func TestEndpointOutageSnoozesTasksWithoutSpendingAttempts(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var down atomic.Bool
	var calls, callsWhileDown atomic.Int32
	down.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if down.Load() {
			callsWhileDown.Add(1)
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "notify", Type: tasksconfig.TypeHTTP, URL: srv.URL, MaxAttempts: 2},
		tasksconfig.Kind{Name: "other", Type: tasksconfig.TypeHTTP, URL: srv.URL})
	cfg.ProbeBackoffMax = 300 * time.Millisecond
	h := start(t, db, cfg, nil)
	for _, k := range []string{"notify", "other"} {
		if metric(t, h, "task_endpoint_up", map[string]string{"task_kind": k}) != 1 ||
			metric(t, h, "task_endpoint_breaker_opened_total", map[string]string{"task_kind": k}) != 0 {
			t.Fatalf("%s: the endpoint metrics must start at up 1, opened 0", k)
		}
	}

	const tasks = 30
	var ids []int64
	for i := range tasks {
		ids = append(ids, enqueueSQL(t, db.Pool, "notify", fmt.Sprintf(`{"n": %d}`, i), `{}`))
	}
	testkit.Eventually(t, 10*time.Second, "the breaker open and every task waiting", func() bool {
		var waiting int
		_ = db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM river_job WHERE kind = 'notify' AND metadata ? 'snoozes'`).Scan(&waiting)
		return metric(t, h, "task_endpoint_up", map[string]string{"task_kind": "notify"}) == 0 && waiting == tasks
	})
	// The outage lasts for three more probes.
	probed := callsWhileDown.Load()
	testkit.Eventually(t, 10*time.Second, "three more probes", func() bool { return callsWhileDown.Load() >= probed+3 })
	down.Store(false)
	for _, id := range ids {
		r := waitState(t, db.Pool, id, "completed", 15*time.Second)
		if r.Errors != 0 || r.Attempt != 1 {
			t.Errorf("task %d: %d errors, attempt %d; want 0 and 1", id, r.Errors, r.Attempt)
		}
	}
	// Without the breaker each task would have called on every snooze.
	if n := callsWhileDown.Load(); n > 2*tasks {
		t.Errorf("%d calls while the endpoint was down for %d tasks: only probes should reach it", n, tasks)
	}
	if metric(t, h, "task_endpoint_up", map[string]string{"task_kind": "notify"}) != 1 ||
		metric(t, h, "task_endpoint_breaker_opened_total", map[string]string{"task_kind": "notify"}) != 1 ||
		metric(t, h, "task_endpoint_up", map[string]string{"task_kind": "other"}) != 1 {
		t.Error("want notify's endpoint up again after one opening, other's untouched")
	}
	warn := h.logs.Lines(t, "task endpoint unavailable; tasks of this kind wait for it without spending attempts, one probes it")
	info := h.logs.Lines(t, "task endpoint available again; tasks of this kind run")
	if len(warn) != 1 || warn[0]["task_kind"] != "notify" || warn[0]["error"] == nil {
		t.Fatalf("open lines: %v", warn)
	}
	if len(info) != 1 || fmt.Sprint(info[0]["tasks_waited"]) != fmt.Sprint(tasks) || info[0]["down_for"] == nil {
		t.Fatalf("close lines: %v", info)
	}
	for _, l := range h.logs.Lines(t, "") {
		if l["level"] != "DEBUG" && l["task_kind"] == "notify" && l["msg"] != warn[0]["msg"] && l["msg"] != info[0]["msg"] && l["msg"] != "task run succeeded" {
			t.Errorf("a line per task during the outage: %v", l)
		}
	}
}

// A task the endpoint refuses as unavailable while it answers the others
// is a poison task: it spends an attempt on each run and is dead-lettered
// after max_attempts, while the other tasks keep flowing.
func TestPoisonTaskDeadLettersWhileTheEndpointServesOthers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var args struct{ Poison bool }
		_ = json.NewDecoder(r.Body).Decode(&args)
		if args.Poison {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "notify", Type: tasksconfig.TypeHTTP, URL: srv.URL})
	cfg.ProbeBackoffMax = 100 * time.Millisecond
	h := start(t, db, cfg, nil)
	poison := enqueueSQL(t, db.Pool, "notify", `{"poison": true}`, `{}`)
	stop := make(chan struct{})
	defer close(stop)
	go func() { // the others, a steady flow
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := db.Pool.Exec(t.Context(), "SELECT worker_enqueue('notify', '{}'::jsonb)"); err != nil {
					return
				}
			}
		}
	}()
	r := waitState(t, db.Pool, poison, "discarded", 20*time.Second)
	if r.Attempt != 3 || r.Errors != 3 {
		t.Fatalf("poison task: attempt %d, %d errors; want 3 and 3", r.Attempt, r.Errors)
	}
	if n := metric(t, h, "job_dlq_total", map[string]string{"job_name": "notify"}); n != 1 {
		t.Errorf("job_dlq_total = %v, want 1", n)
	}
}

// backoff stays between half its ceiling and the ceiling, which doubles up
// to the cap, and is never zero.
func TestProbeBackoffIsCappedAndNeverZero(t *testing.T) {
	t.Parallel()
	for n := 1; n <= 40; n++ {
		ceil := min(100*time.Millisecond<<min(n-1, 30), 5*time.Second)
		for range 50 {
			d := backoff(100*time.Millisecond, 5*time.Second, n)
			if d < ceil/2 || d > ceil || d <= 0 {
				t.Fatalf("backoff(n=%d) = %s, want within [%s, %s]", n, d, ceil/2, ceil)
			}
		}
	}
	if d := backoff(time.Second, 10*time.Millisecond, 1); d > 10*time.Millisecond || d <= 0 {
		t.Errorf("a cap below the base: %s", d)
	}
}

// Closing the breaker wakes the kind's tasks that were snoozed for the
// endpoint, and only those: a task scheduled for later on purpose, or of
// another kind, keeps its time.
func TestClosingTheBreakerWakesTheTasksThatWaited(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	cfg := testConfig(t, nil)
	if err := publishConfig(ctx, db.Pool, &cfg); err != nil {
		t.Fatal(err)
	}
	enqueueLater := func(kind, metadata string) int64 {
		var id int64
		if err := db.Pool.QueryRow(ctx, `SELECT worker_enqueue($1, '{}'::jsonb, metadata => $2::jsonb, scheduled_at => now() + interval '1 hour')`,
			kind, metadata).Scan(&id); err != nil {
			t.Fatal(err)
		}
		// As River leaves a short snooze: available, due later.
		if _, err := db.Pool.Exec(ctx, `UPDATE river_job SET state = 'available' WHERE id = $1`, id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	waited := enqueueLater("notify", `{"endpoint_unavailable_at": "2026-01-01T00:00:00Z", "snoozes": 3}`)
	planned := enqueueLater("notify", `{}`)
	other := enqueueLater("other", `{"endpoint_unavailable_at": "2026-01-01T00:00:00Z"}`)

	m, err := newMetrics(prometheus.NewRegistry(), nil, nil, []string{"notify"})
	if err != nil {
		t.Fatal(err)
	}
	w := &httpWorker{kind: tasksconfig.Kind{Name: "notify"}, pool: db.Pool, endpoint: newEndpointBreaker("notify", m, slog.New(slog.DiscardHandler), time.Second)}
	w.wakeWaiting(ctx)
	for id, wantDue := range map[int64]bool{waited: true, planned: false, other: false} {
		var due bool
		if err := db.Pool.QueryRow(ctx, `SELECT scheduled_at <= now() FROM river_job WHERE id = $1`, id).Scan(&due); err != nil {
			t.Fatal(err)
		}
		if due != wantDue {
			t.Errorf("task %d due now: %v, want %v", id, due, wantDue)
		}
	}
}
