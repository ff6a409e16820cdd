package startup

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/opsserver"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Two SQL jobs hold both connections of the worker's pool for longer than
// their leases' ttl. Their renewals must still get through (leases have a
// pool of their own), so both runs succeed instead of losing their leases.
func TestLeaseRenewalsDoNotWaitForTheWorkersPool(t *testing.T) {
	parts, cleanup, reg := startWired(t, pgtest.New(t), `
jobs:
  - {name: a, kind: sql, sql: "SELECT pg_sleep(3)", delay: 1h, lease_ttl: 1s}
  - {name: b, kind: sql, sql: "SELECT pg_sleep(3)", delay: 1h, lease_ttl: 1s}
`, "APP_DATABASE_MAX_CONNS=2")
	defer cleanup()
	for _, p := range parts {
		defer p.Shutdown(context.Background())
	}
	ended := func(job string) float64 {
		var n float64
		for _, outcome := range []string{"success", "failure", "lease_lost", "timeout"} {
			n += jobRuns(t, reg, job, outcome)
		}
		return n
	}
	testkit.Eventually(t, 20*time.Second, "both runs to end", func() bool { return ended("a") == 1 && ended("b") == 1 })
	for _, job := range []string{"a", "b"} {
		if got := jobRuns(t, reg, job, "success"); got != 1 {
			t.Errorf("job %s: %v successful runs, want 1 (lease_lost %v)", job, got, jobRuns(t, reg, job, "lease_lost"))
		}
	}
}

// jobRuns reads job_runs_total{job_name, outcome} from reg.
func jobRuns(t *testing.T, reg prometheus.Gatherer, job, outcome string) float64 {
	t.Helper()
	v, _ := testkit.Metric(t, reg, "job_runs_total", map[string]string{"job_name": job, "outcome": outcome})
	return v
}

// A database that commits asynchronously for the worker's sessions gets a
// warning at start; the default (on) gets none.
func TestWarnAsyncCommit(t *testing.T) {
	db := pgtest.New(t)
	for mode, wantWarning := range map[string]bool{"off": true, "on": false, "local": false} {
		t.Run(mode, func(t *testing.T) {
			pool := db.NewPool(t, 1, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["synchronous_commit"] = mode })
			logs := &testkit.LogBuffer{}
			warnAsyncCommit(context.Background(), pool, logs.Logger())
			got := strings.Contains(logs.String(), "synchronous_commit is off")
			if got != wantWarning {
				t.Errorf("synchronous_commit=%s: warned %v, want %v; log: %s", mode, got, wantWarning, logs.String())
			}
		})
	}
}

// The lease pool must close within the exit budget's last second, like the
// main pool (closeBounded), even when a lease statement is stuck (here a
// release and a renewal blocked behind a row lock, as on a hung database)
// after the scheduler's Shutdown gave up on a job.
func TestWireCleanupIsBoundedWithALeaseStatementStuck(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	parts, cleanup, _ := startWired(t, db, `
jobs:
  - {name: slow, kind: sql, sql: "SELECT pg_sleep(30)", delay: 1h, lease_ttl: 6s}
`)
	testkit.Eventually(t, 10*time.Second, "the job to run", func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		                            WHERE datname = current_database() AND query LIKE 'SELECT pg_sleep(30)%'`).Scan(&n)
		return n == 1
	})
	// The lease row is locked: the release (and the next renewal) block.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT * FROM worker_lock WHERE key = 'job:slow' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	shutdownAll(parts, 100*time.Millisecond, log)
	start := time.Now()
	cleanup()
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("cleanup took %s: the lease pool's Close waited for a stuck lease statement past the exit budget", took.Round(time.Millisecond))
	}
}

// startWired wires and starts the worker's jobs as `worker run` does, in
// multi-instance mode with the postgres provider and without the outbox,
// on db with the jobs of jobsYAML and the extra environment env. The
// caller stops the components and runs cleanup; the pool closes at the
// end of the test.
func startWired(t *testing.T, db *pgtest.DB, jobsYAML string, env ...string) ([]component, func(), *prometheus.Registry) {
	t.Helper()
	cfg, err := LoadConfig(writeFile(t, jobsYAML), append([]string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false",
		"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres"}, env...))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	// Its pools and listeners are the worker's, opened from the URL: count
	// them in the suite's share (pgtest).
	pgtest.Reserve(t, cfg.MaxDBConns()-opsserver.ProbePoolConns)
	pool, err := connectDB(ctx, cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	reg := prometheus.NewRegistry()
	parts, cleanup, err := wire(t.Context(), cfg, pool, log, reg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range parts {
		if err := p.Start(ctx); err != nil {
			cleanup()
			t.Fatal(err)
		}
	}
	return parts, cleanup, reg
}
