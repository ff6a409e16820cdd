package startup_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Three real worker processes, started at different offsets, share one job.
// A kind: sql job records its own start and end on the database clock. Runs
// must never overlap, every gap from one run's end to the next start must lie
// in [delay, delay+1s], and after SIGKILL of the replica in the middle of a
// run another replica must take over within lease_ttl + delay + 1s.
//
// Serial, as both variants: the bounds are timing, which the parallel
// tests would only stretch.
func TestClusterCadenceAcrossThreeProcesses(t *testing.T) { clusterCadence(t, "postgres") }

// The same with the leases in Redis.
func TestClusterCadenceAcrossThreeProcessesRedis(t *testing.T) { clusterCadence(t, "redis") }

func clusterCadence(t *testing.T, provider string) {
	const (
		delay    = time.Second
		leaseTTL = 3 * time.Second
		window   = 30 * time.Second
	)
	env := append([]string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=" + provider, "APP_LOG_LEVEL=info"}, replicaOnly...)
	// leaseOwner is the owner of the job's current grant, and for the
	// PostgreSQL provider when it was granted and expires.
	var leaseOwner func() (owner string, acquired, expires time.Time)
	switch provider {
	case "postgres":
		if n := workerConns(env, nil); n != replicaConns {
			t.Fatalf("a replica may hold %d connections, want replicaConns = %d", n, replicaConns)
		}
	case "redis":
		prefix := testkit.RedisPrefix(t)
		env = append(env, "APP_LOCK_REDIS_KEY_PREFIX="+prefix)
		rdb := testkit.RedisClient(t)
		leaseOwner = func() (string, time.Time, time.Time) {
			v, _ := rdb.Get(context.Background(), prefix+"{job:tick}").Result() // "<token> <owner>"
			_, owner, _ := strings.Cut(v, " ")
			return owner, time.Time{}, time.Time{}
		}
	}
	pgtest.Need(t, 3*workerConns(env, nil)+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE tick (started_at timestamptz, finished_at timestamptz, app text)`); err != nil {
		t.Fatal(err)
	}
	cfg := configFile(t, fmt.Sprintf(`
jobs:
  - name: tick
    kind: sql
    delay: %s
    lease_ttl: %s
    timeout: 10s
    sql: |
      DO $$
      DECLARE t timestamptz := clock_timestamp();
      BEGIN
        PERFORM pg_sleep(0.3);
        INSERT INTO tick VALUES (t, clock_timestamp(), current_setting('application_name'));
      END $$
`, delay, leaseTTL))
	if leaseOwner == nil {
		leaseOwner = func() (owner string, acquired, expires time.Time) {
			if err := db.Pool.QueryRow(ctx, `SELECT owner, acquired_at, expires_at FROM worker_lock WHERE key = 'job:tick'`).
				Scan(&owner, &acquired, &expires); err != nil {
				t.Fatal(err)
			}
			return owner, acquired, expires
		}
	}
	procs := map[string]*proc{}
	for i := range 3 {
		id := fmt.Sprintf("replica-%d", i)
		procs["worker "+id] = startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfg, "APP_INSTANCE_ID=" + id}, env...))
		time.Sleep(time.Duration(i) * 370 * time.Millisecond) // unsynchronized timers
	}
	time.Sleep(window)

	type run struct {
		start, end time.Time
		app        string
	}
	runs := func() []run {
		rows, err := db.Pool.Query(ctx, `SELECT started_at, finished_at, app FROM tick ORDER BY started_at`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []run
		for rows.Next() {
			var r run
			if err := rows.Scan(&r.start, &r.end, &r.app); err != nil {
				t.Fatal(err)
			}
			out = append(out, r)
		}
		return out
	}
	got := runs()
	if len(got) < int(window/(delay+time.Second))-2 {
		t.Fatalf("only %d runs in %s", len(got), window)
	}
	apps := map[string]int{}
	for i, r := range got {
		apps[r.app]++
		if i == 0 {
			continue
		}
		gap := r.start.Sub(got[i-1].end)
		if gap < delay {
			t.Errorf("run %d started %s after the previous finished: overlap or early start (min %s)", i, gap, delay)
		}
		if gap > delay+time.Second {
			t.Errorf("run %d started %s after the previous finished (max %s)", i, gap, delay+time.Second)
		}
	}
	t.Logf("%d runs in %s; runs per replica: %v", len(got), window, apps)

	// SIGKILL the replica while it runs the job.
	var victim string
	testkit.Eventually(t, 10*time.Second, "a run in progress", func() bool {
		return db.Pool.QueryRow(ctx, `SELECT application_name FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'active' AND query LIKE '%pg_sleep%'
			AND pid <> pg_backend_pid() LIMIT 1`).Scan(&victim) == nil
	})
	killed := time.Now()
	if err := procs[victim].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	limit := leaseTTL + delay + time.Second
	// Where the time goes: the victim's grant expires (at most lease_ttl
	// after its last renewal), a watcher takes the lease over (within a
	// check period), and the next run starts delay after the takeover.
	var expired, takenOver time.Time
	testkit.Eventually(t, limit+5*time.Second, "another replica to take the lease over", func() bool {
		owner, acquired, expires := leaseOwner()
		if owner == "" || strings.HasPrefix(owner, strings.TrimPrefix(victim, "worker ")+"-") {
			expired = expires
			return false
		}
		takenOver = acquired
		return true
	})
	var resumed time.Time
	var by string
	testkit.Eventually(t, limit+5*time.Second, "another replica to resume the job", func() bool {
		err := db.Pool.QueryRow(ctx, `SELECT started_at, app FROM tick WHERE started_at > $1 AND app <> $2
			ORDER BY started_at LIMIT 1`, killed, victim).Scan(&resumed, &by)
		return err == nil
	})
	if provider == "postgres" {
		t.Logf("killed %s; %s resumed the job %s later (limit %s): lease expired after %s, taken over %s later, run started %s after that",
			victim, by, resumed.Sub(killed), limit, expired.Sub(killed), takenOver.Sub(expired), resumed.Sub(takenOver))
	} else {
		t.Logf("killed %s; %s resumed the job %s later (limit %s)", victim, by, resumed.Sub(killed), limit)
	}
	if resumed.Sub(killed) > limit {
		t.Errorf("resumed %s after the kill, limit %s", resumed.Sub(killed), limit)
	}
}
