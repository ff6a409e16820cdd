package jobs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

func createTable(t *testing.T, db *pgtest.DB, ddl string) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), ddl); err != nil {
		t.Fatal(err)
	}
}

func countRows(t *testing.T, db *pgtest.DB, table string) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// While the lease is held, InTx commits, with the run's token, run id and
// the rest of its timeout (plus the grace) as statement_timeout set in the
// transaction.
func TestInTxCommitsWhileLeaseHeld(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createTable(t, db, `CREATE TABLE t (token bigint, run_id text, statement_timeout_ms bigint)`)
	runCtx, lease, ri := runContext(t, postgresLocker(t, db), "job")
	ctx, cancel := context.WithTimeout(runCtx, time.Minute)
	defer cancel()
	err := InTx(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO t SELECT current_setting('worker.fencing_token')::bigint,
			current_setting('worker.run_id'), extract(epoch FROM current_setting('statement_timeout')::interval) * 1000`)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var (
		token, timeoutMS int64
		runID            string
	)
	if err := db.Pool.QueryRow(ctx, `SELECT token, run_id, statement_timeout_ms FROM t`).Scan(&token, &runID, &timeoutMS); err != nil {
		t.Fatal(err)
	}
	if token != lease.Token() || runID != "run-job" {
		t.Errorf("settings token=%d run_id=%q, want %d and run-job", token, runID, lease.Token())
	}
	if timeoutMS <= statementTimeoutGrace.Milliseconds() || timeoutMS > (time.Minute+statementTimeoutGrace).Milliseconds() {
		t.Errorf("statement_timeout = %dms, want the time left of the run's 1m timeout plus %s", timeoutMS, statementTimeoutGrace)
	}
	if !ri.committed.Load() {
		t.Error("the run does not know its transaction committed")
	}
}

// When the lease row shows the grant expired, or taken over by another
// replica, the fence fails: nothing commits, the error says the lease was
// lost, and the lease's Lost fires (so the run's context is cancelled).
func TestInTxRollsBackWhenLeaseNoLongerHeld(t *testing.T) {
	t.Parallel()
	for name, steal := range map[string]string{
		"expired":     `UPDATE worker_lock SET expires_at = clock_timestamp() WHERE key = $1`,
		"taken over":  `UPDATE worker_lock SET owner = 'other', token = nextval('worker_lock_token_seq') WHERE key = $1`,
		"row deleted": `DELETE FROM worker_lock WHERE key = $1`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			createTable(t, db, `CREATE TABLE t (x int)`)
			ctx, lease, ri := runContext(t, postgresLocker(t, db, lock.WithoutHeartbeat()), "job")
			err := InTx(ctx, db.Pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO t VALUES (1)`); err != nil {
					return err
				}
				// Another session changes the lease row while this
				// transaction runs, as a takeover during a pause would.
				_, err := db.Pool.Exec(ctx, steal, lease.Key())
				return err
			})
			if !errors.Is(err, lock.ErrLeaseLost) {
				t.Fatalf("InTx = %v, want ErrLeaseLost", err)
			}
			if n := countRows(t, db, "t"); n != 0 {
				t.Errorf("%d rows committed after the lease was lost", n)
			}
			if ri.committed.Load() {
				t.Error("the run believes its transaction committed")
			}
			select {
			case <-lease.Lost():
			default:
				t.Error("Lost did not fire after the failed fence")
			}
		})
	}
}

func TestInTxNeedsARun(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	err := InTx(context.Background(), db.Pool, func(pgx.Tx) error { return nil })
	if !errors.Is(err, errNoRun) {
		t.Fatalf("InTx outside a run = %v, want errNoRun", err)
	}
}

// A run's context cancelled mid-statement stops the statement on the
// server, and nothing commits.
func TestInTxCancelStopsStatementOnServer(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createTable(t, db, `CREATE TABLE t (x int)`)
	runCtx, _, _ := runContext(t, postgresLocker(t, db), "sleepy")
	ctx, cancel := context.WithCancel(runCtx)
	defer cancel()
	j := &SQLJob{JobName: "sleepy", Pool: db.Pool, SQL: `INSERT INTO t VALUES (1); SELECT pg_sleep(60)`}
	done := make(chan error, 1)
	go func() { done <- j.Run(ctx) }()
	sleeping := func() bool {
		var n int
		err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'active' AND query LIKE '%pg_sleep(60)%' AND pid <> pg_backend_pid()`).Scan(&n)
		return err == nil && n > 0
	}
	testkit.Eventually(t, 10*time.Second, "the job's pg_sleep on the server", sleeping)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	testkit.Eventually(t, 5*time.Second, "pg_sleep to stop on the server", func() bool { return !sleeping() })
	if n := countRows(t, db, "t"); n != 0 {
		t.Errorf("%d rows committed by a cancelled run", n)
	}
}

// Transaction control in a sql job's text ends InTx's transaction early, so
// its writes escape the fence: the run fails and says so, rather than
// succeeding unfenced (or reporting lease_lost for writes that committed).
func TestSQLJobThatEndsItsTransactionFails(t *testing.T) {
	t.Parallel()
	for _, sql := range []string{
		`INSERT INTO t VALUES (1); COMMIT; INSERT INTO t VALUES (2)`,
		`INSERT INTO t VALUES (1); ROLLBACK; INSERT INTO t VALUES (2)`,
		`INSERT INTO t VALUES (1); COMMIT`,
	} {
		t.Run(sql, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			createTable(t, db, `CREATE TABLE t (x int)`)
			ctx, _, ri := runContext(t, postgresLocker(t, db), "ends")
			j := &SQLJob{JobName: "ends", Pool: db.Pool, SQL: sql}
			if err := j.Run(ctx); !errors.Is(err, errTxEnded) {
				t.Fatalf("Run = %v, want errTxEnded", err)
			}
			if ri.committed.Load() {
				t.Error("the run believes its fenced transaction committed")
			}
		})
	}
}

// A sql job that runs past its timeout ends as a timeout with JOB_TIMEOUT,
// every time: the run's deadline fires before the server's
// statement_timeout, which would otherwise turn it into a plain failure.
func TestSQLJobPastItsTimeoutIsTimeout(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	j := &SQLJob{JobName: "sleepy", Pool: db.Pool, SQL: `SELECT pg_sleep(60)`}
	r := startReplica(t, Options{Pool: db.Pool, Locker: postgresLocker(t, db)},
		Spec{Job: j, Delay: 100 * time.Millisecond, Timeout: 300 * time.Millisecond})
	testkit.Eventually(t, 20*time.Second, "3 runs to end", func() bool { return len(r.log.Lines(t, "job run finished")) >= 3 })
	for _, l := range r.log.Lines(t, "job run finished")[:3] {
		if l["outcome"] != OutcomeTimeout || l["error.code"] != obs.CodeJobTimeout {
			t.Errorf("run %v: outcome %v, error.code %v, error %v; want timeout and %s",
				l["run_id"], l["outcome"], l["error.code"], l["error"], obs.CodeJobTimeout)
		}
	}
}

// The outcome says what happened to the run's writes.
func TestClassify(t *testing.T) {
	t.Parallel()
	cancelled := func(cause error) context.Context {
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(cause)
		return ctx
	}
	failed := errors.New("boom")
	for _, c := range []struct {
		name      string
		ctx       context.Context
		err       error
		committed bool
		want      string
	}{
		{"success", context.Background(), nil, true, OutcomeSuccess},
		{"lease lost after the fenced commit", cancelled(lock.ErrLeaseLost), nil, true, OutcomeSuccess},
		{"lease lost, nothing committed", cancelled(lock.ErrLeaseLost), nil, false, OutcomeLeaseLost},
		{"lease lost, rolled back", cancelled(lock.ErrLeaseLost), failed, false, OutcomeLeaseLost},
		{"lease lost, a later step failed", cancelled(lock.ErrLeaseLost), failed, true, OutcomeLeaseLost},
		{"fence failed, context not cancelled yet", context.Background(), fmt.Errorf("rolled back: %w", lock.ErrLeaseLost), false, OutcomeLeaseLost},
		{"timeout", cancelled(errTimeout), failed, false, OutcomeTimeout},
		{"finished just past the timeout", cancelled(errTimeout), nil, true, OutcomeSuccess},
		{"shutdown", cancelled(errShutdown), failed, false, OutcomeCancelled},
		{"committed before shutdown", cancelled(errShutdown), nil, true, OutcomeSuccess},
		{"failure", context.Background(), failed, false, OutcomeFailure},
		{"commit unanswered, lease lost", cancelled(lock.ErrLeaseLost), fmt.Errorf("%w: EOF", ErrCommitUnknown), false, OutcomeFailure},
	} {
		if got, _ := classify(c.ctx, c.err, false, c.committed); got != c.want {
			t.Errorf("%s: outcome %s, want %s", c.name, got, c.want)
		}
	}
}

// Through the scheduler: a run whose fenced transaction committed before
// its lease was lost is a success (with a warning); a run that lost its
// lease before its commit is lease_lost and its writes roll back.
func TestRunOutcomeMatchesCommit(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createTable(t, db, `CREATE TABLE t (job text)`)
	steal := func(ctx context.Context, job string) error {
		_, err := db.Pool.Exec(ctx, `UPDATE worker_lock SET owner = 'thief', token = nextval('worker_lock_token_seq'),
			expires_at = clock_timestamp() + interval '1 hour' WHERE key = $1`, lock.JobKey(job))
		return err
	}
	insert := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO t VALUES (current_setting('worker.run_id'))`)
		return err
	}
	committedFirst := Func("committed-first", func(ctx context.Context) error {
		if err := InTx(ctx, db.Pool, func(tx pgx.Tx) error { return insert(ctx, tx) }); err != nil {
			return err
		}
		if err := steal(ctx, "committed-first"); err != nil {
			return err
		}
		<-ctx.Done() // the heartbeat finds the lease gone
		return nil
	})
	lostFirst := Func("lost-first", func(ctx context.Context) error {
		return InTx(ctx, db.Pool, func(tx pgx.Tx) error {
			if err := insert(ctx, tx); err != nil {
				return err
			}
			return steal(ctx, "lost-first")
		})
	})
	r := startReplica(t, Options{Pool: db.Pool, Locker: postgresLocker(t, db)},
		Spec{Job: committedFirst, Delay: time.Hour, LeaseTTL: time.Second, Timeout: time.Minute},
		Spec{Job: lostFirst, Delay: time.Hour, LeaseTTL: time.Second, Timeout: time.Minute})
	testkit.Eventually(t, 20*time.Second, "both runs to end", func() bool { return len(r.log.Lines(t, "job run finished")) == 2 })
	outcomes := map[string]any{}
	runIDs := map[string]any{}
	for _, l := range r.log.Lines(t, "job run finished") {
		outcomes[l["job"].(string)] = l["outcome"]
		runIDs[l["job"].(string)] = l["run_id"]
	}
	if outcomes["committed-first"] != OutcomeSuccess || outcomes["lost-first"] != OutcomeLeaseLost {
		t.Errorf("outcomes %v; want committed-first success and lost-first lease_lost", outcomes)
	}
	if len(r.log.Lines(t, "job lease lost after the run's fenced transaction committed; the run counts as a success")) != 1 {
		t.Error("no warning for the lease lost after the commit")
	}
	rows, err := db.Pool.Query(context.Background(), `SELECT job FROM t`)
	if err != nil {
		t.Fatal(err)
	}
	committed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(committed) != 1 || committed[0] != runIDs["committed-first"] {
		t.Errorf("committed rows from runs %v; want only committed-first's run %v", committed, runIDs["committed-first"])
	}
}
