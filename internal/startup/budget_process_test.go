package startup_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
)

// connBudget is what one replica may hold with the default pool sizes,
// multi-instance, jobs, tasks and the outbox all busy at once: 3 replicas
// and a rolling-update surge then fit PostgreSQL's default max_connections
// of 100 (docs/operations.md, "Connections").
const connBudget = 20

// One replica with the defaults, every part saturated at once, never holds
// more than connBudget connections. Counted by the server (pg_stat_activity
// of the replica's database), so listeners and River's hijacked LISTEN
// connection count too.
func TestReplicaConnectionsStayWithinBudget(t *testing.T) {
	t.Parallel()
	// The test's database and pool, and the whole budget for the worker.
	pgtest.Need(t, 1+pgtest.PoolConns+connBudget)
	db := pgtest.New(t)
	ctx := context.Background()
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(100 * time.Millisecond) // an endpoint that takes its time
	}))
	t.Cleanup(slow.Close)

	// More sql jobs than executor slots, each holding a connection for its
	// run; sql tasks that hold one of River's; http tasks that keep River's
	// completer busy; and an outbox backlog for the relay.
	var cfg strings.Builder
	cfg.WriteString("jobs:\n")
	for i := range 12 {
		fmt.Fprintf(&cfg, "  - name: busy-%d\n    kind: sql\n    delay: 10ms\n    timeout: 10s\n    sql: SELECT pg_sleep(0.3)\n", i)
	}
	fmt.Fprintf(&cfg, `tasks:
  kinds:
    - name: hold
      type: sql
      sql: SELECT pg_sleep(0.2)
    - name: call
      type: http
      url: %s
`, slow.URL)
	// And an inbox whose webhook receiver is flooded, its work holding a
	// connection of the main pool per request.
	hookAddr := freeAddr(t)
	hookKey := []byte("budget-receiver-secret-32-bytes!")
	fmt.Fprintf(&cfg, `inbox:
  sources:
    - name: hooks
      kind: webhook
      webhook: {addr: %q, secret: whsec_%s}
      handler: {kind: sql, sql: "SELECT pg_sleep(0.05)"}
`, hookAddr, base64.StdEncoding.EncodeToString(hookKey))
	env := []string{
		"APP_DATABASE_URL=" + db.URL,
		"APP_DATABASE_MAX_CONNS=10", // the default, which startWorker lowers for other tests
		"APP_INSTANCE_ID=budget",
		"APP_MULTI_INSTANCE_ENABLED=true",
		"APP_LOCK_PROVIDER=postgres",
		"APP_LOG_LEVEL=warn", // the log sink's event lines still go to stdout
		writeConfig(t, cfg.String()),
	}
	// The worker's own sum of its parts is the budget docs/operations.md states.
	if n := workerConns(env, nil); n != connBudget {
		t.Fatalf("MaxDBConns = %d with the defaults, want the budget of %d", n, connBudget)
	}
	p := startWorker(t, env)
	p.waitReady(t, 30*time.Second)

	// The test's own pool connects without an application_name, which
	// tells its connections apart from the worker's.
	load := db.Pool
	idle := sampleConns(ctx, t, db)
	t.Logf("idle: %d connections %v", total(idle), idle)

	if _, err := load.Exec(ctx, `SELECT worker_enqueue(CASE WHEN i % 2 = 0 THEN 'hold' ELSE 'call' END) FROM generate_series(1, 400) i`); err != nil {
		t.Fatal(err)
	}
	if _, err := load.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', (i % 200)::text, 'order.paid', '{}' FROM generate_series(1, 5000) i`); err != nil {
		t.Fatal(err)
	}
	hooks := floodWebhook(t, hookAddr, hookKey, 300, 32)
	peak, seen := map[string]int{}, maps.Clone(idle) // seen: each part's most
	deadline := time.Now().Add(60 * time.Second)
	for {
		now := sampleConns(ctx, t, db)
		if total(now) > total(peak) {
			peak = now
		}
		for part, n := range now {
			seen[part] = max(seen[part], n)
		}
		var tasksLeft, eventsLeft, messagesDone int
		if err := load.QueryRow(ctx, `SELECT (SELECT count(*) FROM river_job WHERE state NOT IN ('completed', 'discarded', 'cancelled')),
			(SELECT count(*) FROM outbox_event_state WHERE status <> 'PUBLISHED'),
			(SELECT count(*) FROM inbox_message WHERE state = 'PROCESSED')`).Scan(&tasksLeft, &eventsLeft, &messagesDone); err != nil {
			t.Fatal(err)
		}
		if tasksLeft == 0 && eventsLeft == 0 && messagesDone == 300 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("load not drained after 60s: %d tasks, %d events left, %d of 300 inbox messages processed", tasksLeft, eventsLeft, messagesDone)
		}
		time.Sleep(20 * time.Millisecond) // the sampling period, not a synchronization
	}
	<-hooks
	t.Logf("peak under load: %d connections %v", total(peak), peak)
	if total(peak) > connBudget {
		t.Errorf("peak %d connections %v, budget %d", total(peak), peak, connBudget)
	}
	// Every part was exercised: a part that held nothing would make the
	// budget meaningless.
	t.Logf("most per part: %v", seen)
	for _, part := range []string{"worker budget", "worker budget leases", "worker budget tasks", "outbox-listener"} {
		if seen[part] == 0 {
			t.Errorf("no connection of %q seen: %v", part, seen)
		}
	}
	if code, _ := p.get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz = %d after the load", code)
	}
}

// floodWebhook posts n signed messages to a webhook receiver, at most
// conc at a time, resending each answered otherwise than 200 (503 while
// the receiver is full); the channel closes when all are accepted.
func floodWebhook(t *testing.T, addr string, key []byte, n, conc int) <-chan struct{} {
	done := make(chan struct{})
	ids := make(chan int, n)
	for i := range n {
		ids <- i
	}
	close(ids)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for i := range ids {
				id := fmt.Sprintf("hook-%d", i)
				for t.Context().Err() == nil {
					ts := strconv.FormatInt(time.Now().Unix(), 10)
					mac := hmac.New(sha256.New, key)
					mac.Write([]byte(id + "." + ts + ".{}"))
					req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+addr+"/", strings.NewReader("{}"))
					req.Header.Set("webhook-id", id)
					req.Header.Set("webhook-timestamp", ts)
					req.Header.Set("webhook-signature", "v1,"+base64.StdEncoding.EncodeToString(mac.Sum(nil)))
					resp, err := http.DefaultClient.Do(req)
					if err == nil {
						resp.Body.Close()
						if resp.StatusCode == http.StatusOK {
							break
						}
					}
					time.Sleep(10 * time.Millisecond) // the sender's own backoff
				}
			}
		})
	}
	go func() { wg.Wait(); close(done) }()
	return done
}

// sampleConns returns the connections to db per application_name now,
// leaving out the test's own pool, which connects without a name.
func sampleConns(ctx context.Context, t *testing.T, db *pgtest.DB) map[string]int {
	t.Helper()
	rows, err := db.Pool.Query(ctx, `SELECT application_name, count(*) FROM pg_stat_activity
		WHERE datname = $1 AND application_name <> '' GROUP BY 1`, db.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var name string
		var n int
		if err := rows.Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		out[name] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}
