package startup_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// configFile writes a YAML config for one test.
func configFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// sleeping reports whether a backend of db runs pg_sleep right now.
func sleeping(t *testing.T, db *pgtest.DB) bool {
	var n int
	err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND state = 'active' AND query LIKE '%pg_sleep%' AND pid <> pg_backend_pid()`).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n > 0
}

func TestShutdownLetsRunningJobFinish(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), "CREATE TABLE probe (what text)"); err != nil {
		t.Fatal(err)
	}
	cfg := configFile(t, `
jobs:
  - name: slow
    kind: sql
    delay: 1h
    sql: INSERT INTO probe SELECT 'finished' FROM pg_sleep(1.5)
`)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfg, "APP_SHUTDOWN_TIMEOUT=10s"})
	testkit.Eventually(t, 15*time.Second, "the job to run", func() bool { return sleeping(t, db) })

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 2*time.Second, "/readyz to turn 503 while draining", func() bool {
		code, _ := p.get("/readyz")
		return code == http.StatusServiceUnavailable || code == 0 // 0: already gone
	})
	if code := p.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM probe WHERE what = 'finished'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("the running job did not finish before exit (%d rows)", n)
	}

	// The run is visible cluster-wide through `worker jobs list`.
	list := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL}, "jobs", "list")
	if code := list.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("jobs list exit %d", code)
	}
	out := list.out.String()
	for _, want := range []string{"JOB", "NEXT DUE", "slow", "1h0m0s", "success"} {
		if !strings.Contains(out, want) {
			t.Errorf("jobs list lacks %q:\n%s", want, out)
		}
	}
}

func TestShutdownCancelsOverlongJobWithinBudget(t *testing.T) {
	db := pgtest.New(t)
	cfg := configFile(t, `
jobs:
  - name: endless
    kind: sql
    delay: 1h
    timeout: 5m
    sql: SELECT pg_sleep(600)
`)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfg, "APP_SHUTDOWN_TIMEOUT=3s"})
	testkit.Eventually(t, 15*time.Second, "the job to run", func() bool { return sleeping(t, db) })

	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	took := p.exitAt.Sub(sent)
	t.Logf("exited %s after SIGTERM with a 3s budget", took)
	if took > 3*time.Second+500*time.Millisecond {
		t.Errorf("exit took %s, past the 3s budget", took)
	}
	if took < 2*time.Second {
		t.Errorf("exit after %s: the job should have had the budget minus 1s before cancellation", took)
	}
	testkit.Eventually(t, 5*time.Second, "the cancelled query to stop", func() bool { return !sleeping(t, db) })
}

func TestSecondSignalExitsAtOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := configFile(t, `
jobs:
  - name: endless
    kind: sql
    delay: 1h
    sql: SELECT pg_sleep(600)
`)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfg, "APP_SHUTDOWN_TIMEOUT=30s"})
	testkit.Eventually(t, 15*time.Second, "the job to run", func() bool { return sleeping(t, db) })
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 2*time.Second, "draining", func() bool { code, _ := p.get("/readyz"); return code == http.StatusServiceUnavailable })
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 3*time.Second); code != 1 {
		t.Fatalf("exit %d after a second signal, want 1", code)
	}
}

func TestPostgresProviderWithoutTableExits72(t *testing.T) {
	db := pgtest.NewEmpty(t)
	p := startWorker(t, []string{
		"APP_DATABASE_URL=" + db.URL,
		"APP_MULTI_INSTANCE_ENABLED=true",
		"APP_LOCK_PROVIDER=postgres",
		"APP_DATABASE_MIGRATE_ON_START=false",
	})
	if code := p.exitCode(t, 15*time.Second); code != 72 {
		t.Fatalf("exit %d, want 72", code)
	}
	if out := p.out.String(); !strings.Contains(out, "APP_DATABASE_MIGRATE_ON_START") {
		t.Errorf("message should say how to fix it:\n%s", out)
	}
}

// The shutdown contract covers the outbox too: an in-flight publish may
// finish within APP_SHUTDOWN_TIMEOUT minus 1s. The webhook below takes
// 1.5s; the budget is 10s, so SIGTERM must not cut it off.
func TestShutdownLetsInFlightPublishFinish(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var started, completed, cancelled atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started.Add(1)
		select {
		case <-time.After(1500 * time.Millisecond):
			completed.Add(1)
			w.WriteHeader(http.StatusOK)
		case <-r.Context().Done():
			cancelled.Add(1)
		}
	}))
	defer srv.Close()
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_SHUTDOWN_TIMEOUT=10s",
		"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + srv.URL})
	p.waitReady(t, 15*time.Second)
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('order', '1', 'order.paid', '{}')`); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the webhook call", func() bool { return started.Load() == 1 })
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 12*time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
	testkit.Eventually(t, 3*time.Second, "the webhook handler to return", func() bool { return completed.Load()+cancelled.Load() == 1 })
	var status string
	if err := db.Pool.QueryRow(context.Background(), `SELECT status FROM outbox_event_state`).Scan(&status); err != nil {
		t.Fatal(err)
	}
	if status != "PUBLISHED" {
		t.Fatalf("event status %s after SIGTERM with a 10s budget and a 1.5s publish, want PUBLISHED: the publish was cut off", status)
	}
}
