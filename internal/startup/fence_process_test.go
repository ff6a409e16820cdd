package startup_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// pausedReplicas is the reproduction of a paused replica committing after
// it lost its lease: real worker processes share a sql job; the one running
// it is stopped (SIGSTOP) mid-run past its lease, then continued. Its
// transaction must roll back (outcome lease_lost), and no run may commit
// after a run with a higher fencing token started. Commit times are
// measured on the database clock by a deferred constraint trigger, which
// fires inside COMMIT.
type pausedReplicas struct {
	provider string   // lock.provider
	env      []string // more environment for every replica
	replicas int
	cycles   int           // paused runs that must be caught before their commit
	leaseTTL time.Duration // the job's lease_ttl
	// pause is how long a replica stays stopped at least; it is continued
	// once another replica has started the next run, and not before.
	pause time.Duration
}

// Serial: it pauses processes and needs the lease to expire on time; the
// parallel tests would only stretch it.
func TestPausedReplicaNeverCommitsAfterTakeover(t *testing.T) {
	pausedReplicas{provider: "postgres", replicas: 2, cycles: 6, leaseTTL: 2 * time.Second}.run(t)
}

// The same with leases in Redis, whose fence cannot lock the lease until
// the COMMIT: three replicas, ten pauses of 6s past a 3s lease. The
// database refuses the late commits (lock_fence and the idle bound), and
// every refusal at the fence names both tokens. In parallel: Redis and
// the database judge expiry, so a loaded machine only slows it down.
func TestPausedRedisReplicaNeverCommitsLate(t *testing.T) {
	t.Parallel()
	pausedReplicas{
		provider: "redis", env: []string{"APP_LOCK_REDIS_KEY_PREFIX=" + testkit.RedisPrefix(t)},
		replicas: 3, cycles: 10, leaseTTL: 3 * time.Second, pause: 6 * time.Second,
	}.run(t)
}

func (s pausedReplicas) run(t *testing.T) {
	env := append([]string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=" + s.provider, "APP_LOG_LEVEL=info"}, replicaOnly...)
	env = append(env, s.env...)
	pgtest.Need(t, s.replicas*workerConns(env, nil)+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
CREATE TABLE run_log (token bigint, app text, kind text, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE commit_log (token bigint, committed_at timestamptz);
CREATE FUNCTION log_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO commit_log VALUES (NEW.token, clock_timestamp());
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER log_commit AFTER INSERT ON run_log DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW WHEN (NEW.kind = 'end') EXECUTE FUNCTION log_commit();
-- When each run of the job started, as the scheduler recorded it under
-- the lease: before the job's own transaction began. Only this job's: the
-- worker's own jobs (outbox-partitions runs every minute) take tokens
-- under other leases.
CREATE TABLE run_start (token bigint, started_at timestamptz);
CREATE FUNCTION log_start() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO run_start VALUES (NEW.last_token, NEW.last_started_at);
  RETURN NULL;
END $$;
CREATE TRIGGER log_start AFTER UPDATE ON job_state
  FOR EACH ROW WHEN (NEW.name = 'fenced' AND NEW.last_outcome = 'running') EXECUTE FUNCTION log_start();`); err != nil {
		t.Fatal(err)
	}
	cfg := configFile(t, fmt.Sprintf(`
jobs:
  - name: fenced
    kind: sql
    delay: 1s
    lease_ttl: %s
    timeout: 30s
    sql: |
      INSERT INTO run_log (token, app, kind) VALUES (current_setting('worker.fencing_token')::bigint, current_setting('application_name'), 'start');
      SELECT pg_sleep(0.6);
      INSERT INTO run_log (token, app, kind) VALUES (current_setting('worker.fencing_token')::bigint, current_setting('application_name'), 'end');
`, s.leaseTTL))
	procs := map[string]*proc{}
	for i := range s.replicas {
		id := fmt.Sprintf("replica-%c", 'a'+i)
		procs["worker "+id] = startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfg, "APP_INSTANCE_ID=" + id}, env...))
	}

	// A pause counts once it caught a run before its COMMIT. On a loaded
	// machine the SIGSTOP may land after the COMMIT instead; that run is
	// rightly a success (its commit preceded the takeover, which the check
	// below verifies) and the test pauses another run.
	var (
		lost, missed, refused int
		next                  int64 // token of the run after the last paused one
	)
	for attempt := 0; lost < s.cycles; attempt++ {
		if attempt == 3*s.cycles {
			t.Fatalf("only %d of %d pauses caught a run before its commit", lost, attempt)
		}
		var (
			victim string
			token  int64
		)
		testkit.Eventually(t, 20*time.Second, "a new run in its pg_sleep", func() bool {
			return db.Pool.QueryRow(ctx, `SELECT a.application_name, j.last_token
				FROM pg_stat_activity a, job_state j
				WHERE a.datname = current_database() AND a.state = 'active' AND a.query LIKE '%pg_sleep(0.6)%'
				  AND a.pid <> pg_backend_pid() AND j.name = 'fenced' AND j.last_outcome = 'running'
				  AND j.last_token > $1`, next).Scan(&victim, &token) == nil
		})
		p := procs[victim]
		if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		testkit.Eventually(t, 20*time.Second, "another replica to start the next run", func() bool {
			err := db.Pool.QueryRow(ctx, `SELECT last_token FROM job_state
				WHERE name = 'fenced' AND last_token > $1 AND last_outcome = 'running'`, token).Scan(&next)
			return err == nil
		})
		time.Sleep(time.Until(stopped.Add(s.pause))) // the pause itself, not a wait for anything
		if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 20*time.Second, fmt.Sprintf("%s to end its paused run %d", victim, token), func() bool {
			return runEnd(t, p, token) != nil
		})
		// The run that took over commits before the next cycle, so the
		// check below sees commits around every paused run.
		testkit.Eventually(t, 20*time.Second, fmt.Sprintf("run %d to commit", next), func() bool {
			var n int
			return db.Pool.QueryRow(ctx, `SELECT count(*) FROM commit_log WHERE token = $1`, next).Scan(&n) == nil && n == 1
		})

		var rows int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM run_log WHERE token = $1`, token).Scan(&rows); err != nil {
			t.Fatal(err)
		}
		switch outcome := runEnd(t, p, token)["outcome"]; {
		case rows == 0 && outcome == "lease_lost":
			lost++
		case rows == 2 && outcome == "success":
			missed++
		default:
			t.Errorf("paused run %d reported %v with %d rows committed; want lease_lost and none (or success and both, had it committed before the pause)",
				token, outcome, rows)
		}
		if rows == 0 {
			refused += namesBothTokens(t, p, token)
		}
	}
	rows, err := db.Pool.Query(ctx, `
SELECT c.token, c.committed_at, s.token, s.started_at
  FROM commit_log c JOIN run_start s ON s.token > c.token AND s.started_at < c.committed_at`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	late := 0
	for rows.Next() {
		var (
			token, next   int64
			commit, start time.Time
		)
		if err := rows.Scan(&token, &commit, &next, &start); err != nil {
			t.Fatal(err)
		}
		late++
		t.Errorf("run %d committed at %s, %s after run %d started", token, commit.Format(time.StampMicro), commit.Sub(start), next)
	}
	var committed int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM commit_log`).Scan(&committed); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s, %d replicas: %d runs paused before their commit rolled back, each logged with its token and the higher one "+
		"(%d refused at the fence, the rest stopped by the lost lease first); "+
		"%d pauses came after the commit; %d runs committed, %d of them late", s.provider, s.replicas, lost, refused, missed, committed, late)
	if committed < s.cycles {
		t.Errorf("%d committed runs; want at least one after each paused run", committed)
	}
}

// namesBothTokens waits until p has logged, for the paused run with token,
// a line naming our token and a higher one: the fence's refusal, or the
// release that found the lease expired (which follows every lost lease,
// also one the heartbeat noticed before the run reached its fence). It
// returns 1 if the fence refused.
func namesBothTokens(t *testing.T, p *proc, token int64) (refusedAtFence int) {
	t.Helper()
	higher := func(msg string) (found bool) {
		for _, l := range p.out.Lines(t, msg) {
			if fmt.Sprint(l["token"]) != fmt.Sprint(token) {
				continue
			}
			if highest, _ := strconv.ParseInt(fmt.Sprint(l["highest_token"]), 10, 64); highest <= token {
				t.Errorf("%q for run %d names highest_token %v, not a higher one: %v", msg, token, l["highest_token"], l)
			}
			return true
		}
		return false
	}
	testkit.Eventually(t, 10*time.Second, fmt.Sprintf("a line naming run %d's token and the higher one", token), func() bool {
		return higher("lock lease released after it expired; the protected work may have overlapped another holder")
	})
	if higher("lock fence refused the commit: the lease is no longer held") {
		return 1
	}
	return 0
}

// runEnd returns the "job run finished" log line of the run with token,
// or nil.
func runEnd(t *testing.T, p *proc, token int64) map[string]any {
	t.Helper()
	for _, l := range p.out.Lines(t, "job run finished") {
		if fmt.Sprint(l["fencing_token"]) == fmt.Sprint(token) {
			return l
		}
	}
	return nil
}

// A sql job's statement stops on the server when the worker stops it:
// cancelled at the end of the shutdown budget (SIGTERM), the cancel reaches
// the server before the worker exits; and when the worker is killed
// (SIGKILL), statement_timeout (the job's timeout plus 1s) ends it. Without either,
// pg_sleep(60) would run on for a minute.
func TestSQLJobStopsOnServerWhenWorkerStops(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		signal  syscall.Signal
		timeout string
		within  time.Duration
	}{
		{syscall.SIGTERM, "5m", 2 * time.Second},
		{syscall.SIGKILL, "4s", 10 * time.Second},
	} {
		t.Run(c.signal.String(), func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			cfg := configFile(t, fmt.Sprintf(`
jobs:
  - name: endless
    kind: sql
    delay: 1h
    timeout: %s
    sql: SELECT pg_sleep(60)
`, c.timeout))
			p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfg, "APP_SHUTDOWN_TIMEOUT=2s"})
			testkit.Eventually(t, 15*time.Second, "the job to run", func() bool { return sleeping(t, db) })
			if err := p.cmd.Process.Signal(c.signal); err != nil {
				t.Fatal(err)
			}
			p.exitCode(t, 10*time.Second)
			testkit.Eventually(t, c.within, "pg_sleep to stop on the server", func() bool { return !sleeping(t, db) })
			if c.signal == syscall.SIGTERM && !strings.Contains(p.out.String(), `"outcome":"cancelled"`) {
				t.Error("the run was not reported cancelled")
			}
		})
	}
}
