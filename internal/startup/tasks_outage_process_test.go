package startup_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// endpoint is an http task endpoint that can go down (connection refused,
// its open connections closed) and come back on the same address. /hook
// answers 204, /poison 500. It records when it last answered /hook.
type endpoint struct {
	addr string
	mu   sync.Mutex
	srv  *http.Server
	hits map[string]int // path -> 2xx and 5xx answers
	last time.Time      // the last /hook answer
}

func newEndpoint(t *testing.T) *endpoint {
	e := &endpoint{addr: freeAddr(t), hits: map[string]int{}}
	e.up(t)
	t.Cleanup(e.down)
	return e
}

func (e *endpoint) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	e.hits[r.URL.Path]++
	if r.URL.Path == "/hook" {
		e.last = time.Now()
	}
	e.mu.Unlock()
	if r.URL.Path == "/poison" {
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// up listens again on the endpoint's address.
func (e *endpoint) up(t *testing.T) {
	t.Helper()
	var ln net.Listener
	testkit.Eventually(t, 5*time.Second, "the endpoint's address free again", func() bool {
		var err error
		ln, err = net.Listen("tcp", e.addr)
		return err == nil
	})
	srv := &http.Server{Handler: e, ReadHeaderTimeout: 5 * time.Second}
	e.mu.Lock()
	e.srv = srv
	e.mu.Unlock()
	go func() { _ = srv.Serve(ln) }()
}

// down closes the listener and every open connection.
func (e *endpoint) down() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.srv != nil {
		_ = e.srv.Close()
		e.srv = nil
	}
}

func (e *endpoint) lastHook() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.last
}

// outageResult is what one outage of the endpoint cost.
type outageResult struct {
	enqueued, completed, dead int
	catchUp                   time.Duration // from the endpoint's return to the last task answered
	withErrors                int           // tasks with an error recorded (an attempt spent)
}

// runTaskOutage runs a worker with an http kind, takes its endpoint down
// for downFor while enqueueing rate tasks per second, brings it back and
// waits up to drainLimit for every task to complete.
func runTaskOutage(t *testing.T, downFor time.Duration, rate int, drainLimit time.Duration, extraEnv ...string) (outageResult, *proc, *pgtest.DB, *endpoint) {
	t.Helper()
	db := pgtest.New(t)
	ep := newEndpoint(t)
	env := append([]string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false", "APP_LOG_LEVEL=info",
		"APP_TASKS_BACKOFF_BASE=100ms", "APP_TASKS_BACKOFF_MAX=300ms",
		writeConfig(t, fmt.Sprintf(`
tasks:
  kinds:
    - {name: hook, type: http, url: "http://%s/hook"}
    - {name: poison, type: http, url: "http://%s/poison"}
`, ep.addr, ep.addr))}, extraEnv...)
	w := startWorker(t, env)
	w.waitReady(t, 15*time.Second)
	ctx := context.Background()
	enqueue := func(kind string) {
		if _, err := db.Pool.Exec(ctx, "SELECT worker_enqueue($1, '{}'::jsonb)", kind); err != nil {
			t.Fatal(err)
		}
	}

	ep.down()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	n := 0
	for deadline := time.Now().Add(downFor); time.Now().Before(deadline); <-tick.C {
		enqueue("hook")
		n++
	}
	tick.Stop()
	ep.up(t)
	upAt := time.Now()

	count := func(q string) int {
		var c int
		if err := db.Pool.QueryRow(ctx, q).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	var r outageResult
	r.enqueued = n
	testkit.Eventually(t, drainLimit, "every hook task completed or dead", func() bool {
		r.completed = count("SELECT count(*) FROM river_job WHERE kind = 'hook' AND state = 'completed'")
		r.dead = count("SELECT count(*) FROM river_job WHERE kind = 'hook' AND state IN ('discarded', 'cancelled')")
		return r.completed+r.dead == n
	})
	r.catchUp = ep.lastHook().Sub(upAt)
	r.withErrors = count("SELECT count(*) FROM river_job WHERE kind = 'hook' AND cardinality(errors) > 0")
	return r, w, db, ep
}

// metricValue reads one series from the worker's /metrics.
func metricValue(t *testing.T, w *proc, series string) float64 {
	t.Helper()
	_, body := w.get("/metrics")
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no series %s in /metrics", series)
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

// An http task endpoint down for a few seconds while tasks are enqueued
// costs no task an attempt: none is dead-lettered, all are delivered
// within 10 s of its return, the breaker logs one WARN and one INFO and
// no line per task. A task the endpoint fails (500) while it is up still
// goes to the dead letters after max_attempts (3), before and after the
// outage.
func TestHTTPTaskEndpointOutage(t *testing.T) {
	t.Parallel()
	downFor := 3 * time.Second
	if v := os.Getenv("WORKER_TASK_OUTAGE"); v != "" {
		// The 30 s and 120 s outages: WORKER_TASK_OUTAGE=120s.
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("WORKER_TASK_OUTAGE=%q: want a positive duration", v)
		}
		downFor = d
	}
	r, w, db, _ := runTaskOutage(t, downFor, 20, downFor+30*time.Second, "APP_TASKS_PROBE_BACKOFF_MAX=500ms")
	t.Logf("%d tasks enqueued while the endpoint was down: %d completed, %d dead, %d with an error, the last one %s after its return",
		r.enqueued, r.completed, r.dead, r.withErrors, r.catchUp.Round(time.Millisecond))
	if r.dead != 0 || r.withErrors != 0 || r.completed != r.enqueued {
		t.Errorf("%d dead, %d with an attempt spent, %d of %d completed; want 0, 0 and all", r.dead, r.withErrors, r.completed, r.enqueued)
	}
	if r.catchUp > 10*time.Second {
		t.Errorf("the last task was delivered %s after the endpoint's return, want within 10s", r.catchUp)
	}
	if up, opened := metricValue(t, w, `task_endpoint_up{task_kind="hook"}`),
		metricValue(t, w, `task_endpoint_breaker_opened_total{task_kind="hook"}`); up != 1 || opened != 1 {
		t.Errorf("task_endpoint_up %v, opened %v; want 1 and 1", up, opened)
	}
	open := w.out.Lines(t, "task endpoint unavailable; tasks of this kind wait for it without spending attempts, one probes it")
	closed := w.out.Lines(t, "task endpoint available again; tasks of this kind run")
	// Tasks enqueued in the outage's last instants may run only after it.
	if len(open) != 1 || len(closed) != 1 {
		t.Fatalf("breaker lines: opened %v, closed %v; want one each", open, closed)
	}
	if waited, _ := strconv.ParseFloat(fmt.Sprint(closed[0]["tasks_waited"]), 64); waited < float64(r.enqueued)/2 || waited > float64(r.enqueued) {
		t.Errorf("tasks_waited %v, want most of the %d tasks enqueued during the outage", closed[0]["tasks_waited"], r.enqueued)
	}
	for _, l := range w.out.Lines(t, "") {
		if l["task_kind"] == "hook" && (l["level"] == "WARN" || l["level"] == "ERROR") && l["msg"] != open[0]["msg"] {
			t.Errorf("a line per task during the outage: %v", l)
		}
	}

	// The poison kind, while the endpoint is up: 500 three times, then
	// the dead letters.
	ctx := context.Background()
	var poison int64
	if err := db.Pool.QueryRow(ctx, "SELECT worker_enqueue('poison', '{}'::jsonb)").Scan(&poison); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the poison task dead-lettered", func() bool {
		var state string
		var attempt int
		_ = db.Pool.QueryRow(ctx, "SELECT state::text, attempt FROM river_job WHERE id = $1", poison).Scan(&state, &attempt)
		return state == "discarded" && attempt == 3
	})
	if n := metricValue(t, w, `job_dlq_total{job_name="poison"}`); n != 1 {
		t.Errorf("job_dlq_total{poison} = %v, want 1", n)
	}
}
