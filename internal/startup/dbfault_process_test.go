package startup_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pgtest/cluster"
	"github.com/worker-dev/worker/internal/soak/load"
	"github.com/worker-dev/worker/internal/testkit"
)

// The database goes away under two replicas in multi-instance mode
// (PostgreSQL leases) that run everything at once: the sql job every
// 500 ms, the outbox at 300 events a second over 100 aggregates to a
// webhook receiver, the inbox from signed webhooks, and sql tasks. The
// database is a private server (pgtest/cluster), and in turn it is
// restarted (pg_ctl restart -m fast), crashed (pg_ctl stop -m immediate,
// started 10 s later: crash recovery), and has every session ended
// (pg_terminate_backend). After each:
//   - every committed event arrived, first deliveries in order per
//     aggregate (duplicates are allowed: delivery is at least once);
//   - every inbox delivery taken and every sql task enqueued was applied
//     exactly once;
//   - no job run committed after a run with a later fencing token started,
//     and no token committed twice;
//   - both replicas are ready within 5 s of the database accepting
//     connections, and neither process restarted.
//
// While the database is down for the crash, /readyz says not ready, and
// each replica logs one ERROR line that says why and one line when it
// returns. No other ERROR line is logged in the whole test: an outage is
// one line, not one per failed statement.
func TestDatabaseFaults(t *testing.T) {
	t.Parallel()
	db := cluster.New(t)
	ctx := t.Context()
	if err := db.Exec(ctx, "postgres", "CREATE DATABASE worker"); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, db.URL("worker")+"&pool_max_conns=4&application_name=load")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, load.Schema); err != nil {
		t.Fatal(err)
	}
	recv := load.NewReceiver(dbFaultAggregates)
	t.Cleanup(recv.Close) // before the replicas' cleanups: runs after they are killed
	key := []byte("a-receiver-secret-of-32-bytes!!!")
	replicas := make([]*proc, 2)
	var hooks []string
	for i := range replicas {
		inbox := freeAddr(t)
		hooks = append(hooks, "http://"+inbox+"/hooks")
		replicas[i] = startWorker(t, []string{
			"APP_DATABASE_URL=" + db.URL("worker"), "APP_INSTANCE_ID=" + replicaID(i),
			"APP_CONFIG_FILE=" + configFile(t, load.WorkerConfig(inbox, base64.StdEncoding.EncodeToString(key))),
			"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres", "APP_LOG_LEVEL=info",
			"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + recv.URL,
			// A producer event must never go DEAD, whatever the outage.
			"APP_OUTBOX_MAX_ATTEMPTS=1000", "APP_OUTBOX_BACKOFF_BASE=100ms", "APP_OUTBOX_BACKOFF_MAX=1s",
			"APP_TASKS_BACKOFF_BASE=100ms", "APP_TASKS_BACKOFF_MAX=1s",
		})
		// One after the other: the first applies the migrations.
		replicas[i].waitReady(t, 60*time.Second)
	}
	prod := load.StartProducer(pool, dbFaultAggregates, 300)
	send := load.StartSender(hooks, key, 20)
	enq := load.StartEnqueuer(pool, 20)
	t.Cleanup(func() { prod.Stop(); send.Stop(); enq.Stop() })
	f := &dbFaults{t: t, db: db, pool: pool, recv: recv, prod: prod, send: send, enq: enq, replicas: replicas}
	f.awaitProgress()

	f.fault("restart -m fast", func() time.Time {
		if err := db.Restart(); err != nil {
			t.Fatal(err)
		}
		return time.Now()
	})
	f.fault("stop -m immediate, start 10 s later", func() time.Time {
		if err := db.StopImmediate(); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		// The database is away for 10 s: meanwhile both replicas must say
		// so on /readyz.
		for _, p := range replicas {
			testkit.Eventually(t, 8*time.Second, "/readyz to say the database is unreachable", func() bool {
				code, body := p.get("/readyz")
				return code == http.StatusServiceUnavailable && strings.Contains(body, "database unreachable")
			})
		}
		time.Sleep(10*time.Second - time.Since(stopped)) // the outage itself, not a wait for a condition
		if err := db.Start(); err != nil {
			t.Fatal(err)
		}
		return time.Now()
	})
	f.fault("pg_terminate_backend of every session", func() time.Time {
		n, err := db.TerminateBackends(ctx, "%")
		if err != nil || n == 0 {
			t.Fatalf("pg_terminate_backend ended %d sessions (%v), want the workers'", n, err)
		}
		t.Logf("pg_terminate_backend ended %d sessions", n)
		return time.Now()
	})

	for i, p := range replicas {
		var errs []string
		for _, l := range p.out.Lines(t, "") {
			if l["level"] == "ERROR" {
				errs = append(errs, fmt.Sprint(l["msg"]))
			}
		}
		down := p.out.Lines(t, dbUnreachableMsg)
		back := p.out.Lines(t, dbReachableMsg)
		t.Logf("%s: %d database unreachable ERROR lines, %d recovery lines", replicaID(i), len(down), len(back))
		// The crash always counts; the fast restart may be too short for
		// a ping to see it.
		if len(down) < 1 || len(down) > 2 || len(back) != len(down) {
			t.Errorf("%s: %d database unreachable lines and %d recovery lines; want one each per outage seen (1 or 2)", replicaID(i), len(down), len(back))
		}
		if len(errs) != len(down) {
			t.Errorf("%s: ERROR lines %q; want only the database's, one per outage", replicaID(i), errs)
		}
		for _, l := range down {
			if l["level"] != "ERROR" || l["error.code"] != "DATABASE_UNAVAILABLE" {
				t.Errorf("%s: outage line %v; want an ERROR with error.code DATABASE_UNAVAILABLE", replicaID(i), l)
			}
		}
	}
}

const (
	dbFaultAggregates = 100
	dbUnreachableMsg  = "database unreachable; jobs, the outbox, the inbox and tasks wait for it and resume by themselves when it answers"
	dbReachableMsg    = "database reachable again; jobs, the outbox, the inbox and tasks resume"
)

// dbFaults is TestDatabaseFaults' replicas, load and database.
type dbFaults struct {
	t        *testing.T
	db       *cluster.Cluster
	pool     *pgxpool.Pool
	recv     *load.Receiver
	prod     *load.Producer
	send     *load.Sender
	enq      *load.Enqueuer
	replicas []*proc
}

// fault injects one fault with do, which returns when the database
// accepts connections again, and checks every promise after it.
func (f *dbFaults) fault(name string, do func() (accepting time.Time)) {
	t := f.t
	t.Helper()
	began := time.Now()
	accepting := do()
	// Ready again: /readyz polled every 20 ms from the moment the
	// database accepts connections.
	for _, p := range f.replicas {
		if _, err := p.ready(5*time.Second - time.Since(accepting)); err != nil {
			t.Fatalf("after %s: %s not ready within 5 s of the database accepting connections: %v", name, p.addr, err)
		}
	}
	toReady := time.Since(accepting)
	f.awaitProgress()

	// Everything committed so far arrives, in order; all the work is
	// applied once.
	committed := f.prod.Committed()
	testkit.Eventually(t, 60*time.Second, "every event committed before the check to arrive", func() bool {
		return f.recv.Lost(committed, dbFaultAggregates) == 0
	})
	inboxSent, tasksSent := f.send.Sent(), f.enq.Sent()
	var c load.Counts
	testkit.Eventually(t, 60*time.Second, "every sql task enqueued to be applied", func() bool {
		var err error
		c, err = load.Applied(context.Background(), f.pool, inboxSent, tasksSent)
		return err == nil && c.TaskMissing == 0
	})
	if err := load.Jobs(context.Background(), f.pool, &c); err != nil {
		t.Fatal(err)
	}
	dups, outOfOrder := f.recv.Outcome()
	for _, p := range f.replicas {
		select {
		case <-p.done:
			t.Fatalf("after %s: a replica exited, code %d", name, p.cmd.ProcessState.ExitCode())
		default:
		}
	}
	t.Logf("%s: database away %s, both replicas ready %s after it accepted connections; "+
		"%d events committed, 0 lost, %d out of order, %d duplicates; inbox %d taken, %d applied; tasks %d enqueued, %d applied; job %d runs",
		name, accepting.Sub(began).Round(time.Millisecond), toReady.Round(time.Millisecond),
		committed, len(outOfOrder), dups, inboxSent, c.InboxApplied, tasksSent, c.TaskApplied, c.JobRuns)
	for _, o := range slices.Concat(outOfOrder, c.Problems()) {
		t.Errorf("after %s: %s", name, o)
	}
}

// awaitProgress waits until 300 more events arrived for the first time.
func (f *dbFaults) awaitProgress() {
	want := f.recv.Firsts() + 300
	testkit.Eventually(f.t, 60*time.Second, "events to flow", func() bool { return f.recv.Firsts() >= want })
}
