package jobs

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// run is one row of the cluster test's runs table: database-clock times
// written by the job's own SQL.
type clusterRun struct {
	instance          string
	token             int64
	started, finished time.Time
}

// TestClusterFixedDelay runs three replicas, each with its own pool and
// PostgreSQL lock provider, started at random offsets. On the database
// clock, runs never overlap and each starts between delay and delay+1s
// after the previous one ended. Then the replica running the job is cut
// off mid-run without releasing anything, and another replica must run
// the job within lease_ttl + delay + 1s.
func TestClusterFixedDelay(t *testing.T) {
	const (
		delay = time.Second
		ttl   = 2 * time.Second
	)
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE runs (instance text, token bigint, started_at timestamptz, finished_at timestamptz)`); err != nil {
		t.Fatal(err)
	}
	names := []string{"r1", "r2", "r3"}
	pools := map[string]*pgxpool.Pool{}
	replicas := map[string]*replica{}
	lockRegs := map[string]*prometheus.Registry{}
	for _, name := range names {
		pool := namedPool(t, db, name)
		pools[name] = pool
		pg, err := lock.NewPostgres(pool, name, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pg.Close)
		lockRegs[name] = prometheus.NewRegistry()
		locker, err := lock.WithMetrics(pg, lockRegs[name])
		if err != nil {
			t.Fatal(err)
		}
		specs, err := FromDefinitions([]jobsconfig.Definition{{Name: "tick", Kind: jobsconfig.KindSQL, Delay: delay, LeaseTTL: ttl, SQL: fmt.Sprintf(`
INSERT INTO runs VALUES ('%s', current_setting('worker.fencing_token')::bigint, clock_timestamp(), NULL);
SELECT pg_sleep(0.2);
UPDATE runs SET finished_at = clock_timestamp() WHERE token = current_setting('worker.fencing_token')::bigint;`, name)}}, pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(rand.N(700 * time.Millisecond)) // unsynchronized timers
		replicas[name] = startReplica(t, Options{Pool: pool, Locker: locker, InstanceID: name}, specs...)
	}

	testkit.Eventually(t, 20*time.Second, "5 finished runs", func() bool { return len(finishedRuns(t, db.Pool)) >= 5 })
	// What the lock store pays for the cadence: per run, the winner's
	// acquisition, each other replica's look at the due time after the run
	// ended and its attempt at the due time, and probes while the run lasts.
	acquired, timedOut := 0.0, 0.0
	for _, reg := range lockRegs {
		acquired += metric(t, reg, "lock_acquisition_total", map[string]string{"outcome": lock.OutcomeAcquired, "provider": "postgres"})
		timedOut += metric(t, reg, "lock_acquisition_total", map[string]string{"outcome": lock.OutcomeTimeout, "provider": "postgres"})
	}
	t.Logf("lock store, %d replicas: %v leases acquired and %v attempts found the lease held, for %d finished runs",
		len(names), acquired, timedOut, len(finishedRuns(t, db.Pool)))

	// A graceful stop (SIGTERM) of the replica running the job: it finishes
	// the run within its budget, and another replica keeps the cadence.
	running := func() string {
		var name string
		testkit.Eventually(t, 10*time.Second, "a run in progress", func() bool {
			// The job's own rows are invisible until it commits; job_state
			// shows the run from its start.
			err := db.Pool.QueryRow(ctx, `SELECT last_instance FROM job_state WHERE name = 'tick' AND last_outcome = 'running'`).Scan(&name)
			return err == nil
		})
		return name
	}
	stopped := running()
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := replicas[stopped].s.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	n := len(finishedRuns(t, db.Pool))
	testkit.Eventually(t, 10*time.Second, "two more runs", func() bool { return len(finishedRuns(t, db.Pool)) >= n+2 })
	all := finishedRuns(t, db.Pool)
	checkCadence(t, all, delay)
	if last := all[len(all)-1]; last.instance == stopped {
		t.Fatalf("stopped replica %s still runs the job", stopped)
	}

	// Cut off the replica that is running the job: its connections die,
	// so it can neither record the end nor release or renew its lease.
	victim := running()
	var crashAt time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&crashAt); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() { pools[victim].Close(); close(closed) }() // blocks until its connections are gone
	if _, err := db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = $1`, victim); err != nil {
		t.Fatal(err)
	}
	<-closed

	var resumed clusterRun
	testkit.Eventually(t, ttl+delay+5*time.Second, "another replica to resume the job", func() bool {
		err := db.Pool.QueryRow(ctx, `SELECT instance, started_at FROM runs WHERE started_at > $1 ORDER BY started_at LIMIT 1`,
			crashAt).Scan(&resumed.instance, &resumed.started)
		return err == nil
	})
	if resumed.instance == victim {
		t.Fatalf("the cut-off replica %s ran the job again", victim)
	}
	lag := resumed.started.Sub(crashAt)
	t.Logf("%s was cut off mid-run; %s resumed the job %s later", victim, resumed.instance, lag)
	if lag > ttl+delay+time.Second {
		t.Errorf("job resumed %s after the crash; want at most lease_ttl+delay+1s = %s", lag, ttl+delay+time.Second)
	}
	// The survivors keep the cadence among themselves.
	testkit.Eventually(t, 10*time.Second, "two runs after the crash", func() bool {
		n := 0
		for _, r := range finishedRuns(t, db.Pool) {
			if r.started.After(crashAt) {
				n++
			}
		}
		return n >= 2
	})
	var after []clusterRun
	for _, r := range finishedRuns(t, db.Pool) {
		if r.started.After(crashAt) {
			after = append(after, r)
		}
	}
	checkCadence(t, after, delay)

	// Replicas that found the job held or not yet due skipped quietly:
	// counted, never logged as errors.
	var skipped float64
	for name, r := range replicas {
		skipped += runs(t, r.reg, "tick", OutcomeSkippedLocked) + runs(t, r.reg, "tick", OutcomeSkippedNotDue)
		if name == victim {
			continue
		}
		for _, l := range r.log.Lines(t, "") {
			if l["level"] == "ERROR" {
				t.Errorf("%s logged an error: %v", name, l)
			}
		}
	}
	if skipped == 0 {
		t.Error("no replica counted a skipped attempt")
	}
}

// namedPool opens a pool whose sessions carry application_name, so the
// test can kill exactly that replica's connections.
func namedPool(t *testing.T, db *pgtest.DB, name string) *pgxpool.Pool {
	t.Helper()
	pool := db.NewPool(t, 4, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = name })
	return pool
}

func finishedRuns(t *testing.T, pool *pgxpool.Pool) []clusterRun {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT instance, token, started_at, finished_at FROM runs WHERE finished_at IS NOT NULL ORDER BY started_at`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []clusterRun
	for rows.Next() {
		var r clusterRun
		if err := rows.Scan(&r.instance, &r.token, &r.started, &r.finished); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// checkCadence asserts the cluster-wide fixed delay on consecutive runs.
func checkCadence(t *testing.T, rs []clusterRun, delay time.Duration) {
	t.Helper()
	var minGap, maxGap time.Duration
	for i := 1; i < len(rs); i++ {
		prev, cur := rs[i-1], rs[i]
		gap := cur.started.Sub(prev.finished)
		if i == 1 || gap < minGap {
			minGap = gap
		}
		maxGap = max(maxGap, gap)
		if gap < delay || gap > delay+time.Second {
			t.Errorf("run %d (%s, token %d) started %s after run %d (%s) finished; want between %s and %s",
				i, cur.instance, cur.token, gap, i-1, prev.instance, delay, delay+time.Second)
		}
		if cur.token <= prev.token {
			t.Errorf("fencing token %d after %d", cur.token, prev.token)
		}
	}
	instances := map[string]bool{}
	for _, r := range rs {
		instances[r.instance] = true
	}
	t.Logf("%d runs on %d replicas; gaps between %s and %s", len(rs), len(instances), minGap, maxGap)
}
