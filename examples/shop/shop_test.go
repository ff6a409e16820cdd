package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestMain lets the test binary be the shop binary too: the test starts
// itself with SHOP_TEST_RUN_MAIN=1 as a real process, which gets signals
// and exits with its own code.
func TestMain(m *testing.M) {
	if os.Getenv("SHOP_TEST_RUN_MAIN") == "1" {
		os.Exit(run())
	}
	os.Exit(m.Run())
}

var orders = []string{"a-1", "b-2", "c-3", "d-4"}

const shipmentsPerOrder = 3

// TestShop runs the shop binary against PostgreSQL and shows that the Go
// job ran under its lease, that each task ran exactly once, that the
// custom sink received the events in per-aggregate order, and that a
// rolled-back handler left no event and no task.
func TestShop(t *testing.T) {
	t.Parallel()
	dbURL, db := newDatabase(t)
	shop := startShop(t, dbURL)

	// The first order waits for the worker's migrations (tasks.Enqueue
	// needs them); the handler's transaction rolls back until then.
	eventually(t, "the first order placed", func() bool { return shop.post(t, "/orders/"+orders[0]) == http.StatusNoContent })
	for _, id := range orders[1:] {
		shop.mustPost(t, "/orders/"+id, http.StatusNoContent)
	}
	for range shipmentsPerOrder {
		for _, id := range orders {
			shop.mustPost(t, "/orders/"+id+"/ship", http.StatusNoContent)
		}
	}
	// Rolled back: a new order (row, event, task) and a shipment.
	shop.mustPost(t, "/orders/x-9?fail=1", http.StatusInternalServerError)
	shop.mustPost(t, "/orders/a-1/ship?fail=1", http.StatusInternalServerError)

	events := len(orders) * (1 + shipmentsPerOrder)
	eventually(t, "every event in the ledger, every task completed, two sweeps", func() bool {
		return count(t, db, "SELECT count(*) FROM shop_ledger") == events &&
			count(t, db, "SELECT count(*) FROM river_job WHERE kind = 'send-receipt' AND state = 'completed'") == len(orders) &&
			count(t, db, "SELECT count(*) FROM shop_sweep") >= 2
	})

	t.Run("the job ran under its lease", func(t *testing.T) {
		tokens := column[int64](t, db, "SELECT fencing_token FROM shop_sweep ORDER BY id")
		if tokens[0] <= 0 || !slices.IsSorted(tokens) || len(slices.Compact(slices.Clone(tokens))) != len(tokens) {
			t.Fatalf("fencing tokens of the sweeps = %v, want strictly increasing and positive", tokens)
		}
		lease := column[int64](t, db, "SELECT token FROM worker_lock WHERE key = 'job:close-stale-orders'")
		if len(lease) != 1 || lease[0] < tokens[len(tokens)-1] {
			t.Fatalf("lease job:close-stale-orders token %v, want at least the last sweep's %d", lease, tokens[len(tokens)-1])
		}
		t.Logf("%d sweeps, fencing tokens %v", len(tokens), tokens)
	})

	t.Run("each task ran exactly once", func(t *testing.T) {
		for _, id := range orders {
			if n := count(t, db, "SELECT count(*) FROM shop_receipt WHERE order_id = '"+id+"'"); n != 1 {
				t.Errorf("order %s: %d receipts, want 1", id, n)
			}
		}
		if n := count(t, db, "SELECT count(*) FROM shop_receipt r JOIN river_job j ON j.id = r.task_id WHERE j.attempt = 1 AND j.state = 'completed'"); n != len(orders) {
			t.Errorf("%d receipts from a completed first attempt, want %d", n, len(orders))
		}
	})

	t.Run("the sink received the events in per-aggregate order", func(t *testing.T) {
		for _, id := range orders {
			written := column[string](t, db, "SELECT event_id::text FROM outbox_event WHERE aggregate_id = '"+id+"' ORDER BY id")
			received := column[string](t, db, "SELECT event_id::text FROM shop_ledger WHERE aggregate_id = '"+id+"' ORDER BY id")
			if !slices.Equal(written, received) || len(written) != 1+shipmentsPerOrder {
				t.Errorf("order %s: written %v, the sink received %v", id, written, received)
			}
		}
		if n := count(t, db, "SELECT count(*) FROM outbox_event_state WHERE status <> 'PUBLISHED'"); n != 0 {
			t.Errorf("%d events not published", n)
		}
	})

	t.Run("a rolled-back handler left no event and no task", func(t *testing.T) {
		checks := map[string]int{
			"SELECT count(*) FROM shop_order WHERE id = 'x-9'":                            0,
			"SELECT count(*) FROM outbox_event WHERE aggregate_id = 'x-9'":                0,
			"SELECT count(*) FROM river_job WHERE args->>'order_id' = 'x-9'":              0,
			"SELECT count(*) FROM outbox_event WHERE aggregate_id = 'a-1'":                1 + shipmentsPerOrder,
			"SELECT count(*) FROM shop_ledger WHERE aggregate_id = 'x-9'":                 0,
			"SELECT count(*) FROM river_job WHERE kind = 'send-receipt'":                  len(orders),
			"SELECT count(*) FROM outbox_event WHERE event_type = 'order.placed'":         len(orders),
			"SELECT count(*) FROM outbox_event WHERE event_type = 'order.shipped'":        len(orders) * shipmentsPerOrder,
			"SELECT count(*) FROM shop_ledger WHERE event_type = 'order.shipped'":         len(orders) * shipmentsPerOrder,
			"SELECT count(*) FROM shop_order WHERE id = ANY('{a-1,b-2,c-3,d-4}'::text[])": len(orders),
		}
		for q, want := range checks {
			if got := count(t, db, q); got != want {
				t.Errorf("%s = %d, want %d", q, got, want)
			}
		}
	})

	t.Run("SIGTERM stops it with exit 0", func(t *testing.T) {
		if code := shop.stop(t); code != 0 {
			t.Fatalf("exit code %d, want 0; output:\n%s", code, shop.stderr.String())
		}
		// Run returned only after the API's OnReady function did.
		select {
		case <-shop.stopped:
		default:
			t.Fatal("the worker exited before the shop's API stopped")
		}
	})
	t.Logf("%d orders, %d events relayed through the ledger sink, %d tasks, rolled-back order x-9 left nothing", len(orders), events, len(orders))
}

// The operator commands never start the shop's API: it starts through
// WithOnReady, which only `run` calls once it is ready.
func TestOperatorCommandsStartNoAPI(t *testing.T) {
	t.Parallel()
	empty := t.TempDir() + "/worker.yaml"
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "config", "print")
	cmd.Env = append(os.Environ(),
		"SHOP_TEST_RUN_MAIN=1",
		"SHOP_ADDR=127.0.0.1:0",
		"APP_CONFIG_FILE="+empty,
		// Nothing listens there: the command must not need the database.
		"APP_DATABASE_URL=postgres://shop@127.0.0.1:1/shop?connect_timeout=1",
	)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("config print: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "shop listening") || !strings.Contains(string(out), "outbox:") {
		t.Fatalf("config print started the API, or printed no configuration:\n%s", out)
	}
}

// newDatabase creates an empty database for the test, dropped at its end:
// the shop's worker migrates it, as in production.
func newDatabase(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	admin := os.Getenv("WORKER_TEST_DATABASE_URL")
	if admin == "" {
		admin = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatalf("PostgreSQL (WORKER_TEST_DATABASE_URL): %v", err)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "shop_test_" + hex.EncodeToString(b)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(admin)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
		_ = conn.Close(ctx)
	})
	return u.String(), pool
}

type shopProcess struct {
	cmd     *exec.Cmd
	addr    string
	stderr  *lockedBuffer
	done    chan int
	stopped chan struct{} // closed when the shop's API says it stopped
}

// startShop runs the shop as a process, multi-instance with the postgres
// lock provider and the ledger sink, and returns once it listens.
func startShop(t *testing.T, dbURL string) *shopProcess {
	t.Helper()
	empty := t.TempDir() + "/worker.yaml"
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "run")
	cmd.Env = append(os.Environ(),
		"SHOP_TEST_RUN_MAIN=1",
		"SHOP_ADDR=127.0.0.1:0",
		"APP_CONFIG_FILE="+empty,
		"APP_DATABASE_URL="+dbURL,
		"APP_HTTP_ADDR=127.0.0.1:0",
		"APP_MULTI_INSTANCE_ENABLED=true",
		"APP_LOCK_PROVIDER=postgres",
		"APP_OUTBOX_SINK=ledger",
	)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &shopProcess{cmd: cmd, stderr: &lockedBuffer{}, done: make(chan int, 1), stopped: make(chan struct{})}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	addrs := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "shop listening on "); ok {
				addrs <- a
			}
			if sc.Text() == "shop stopped" {
				close(p.stopped)
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() {
		_ = cmd.Wait()
		p.done <- cmd.ProcessState.ExitCode()
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	select {
	case p.addr = <-addrs:
	case code := <-p.done:
		t.Fatalf("shop exited with %d before listening:\n%s", code, p.stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatal("shop did not listen within 30s")
	}
	return p
}

func (p *shopProcess) post(t *testing.T, path string) int {
	t.Helper()
	resp, err := http.Post("http://"+p.addr+path, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode
}

func (p *shopProcess) mustPost(t *testing.T, path string, want int) {
	t.Helper()
	if got := p.post(t, path); got != want {
		t.Fatalf("POST %s: %d, want %d", path, got, want)
	}
}

func (p *shopProcess) stop(t *testing.T) int {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-p.done:
		return code
	case <-time.After(60 * time.Second):
		t.Fatal("shop did not stop within 60s of SIGTERM")
		return -1
	}
}

func count(t *testing.T, db *pgxpool.Pool, query string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), query).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

func column[T any](t *testing.T, db *pgxpool.Pool, query string) []T {
	t.Helper()
	rows, _ := db.Query(context.Background(), query)
	list, err := pgx.CollectRows(rows, pgx.RowTo[T])
	if err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return list
}

// eventually polls cond until it holds, for at most a minute.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within a minute: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lockedBuffer lets the process's stderr be read while it is written.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(b)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
