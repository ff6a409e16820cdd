package jobs

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// num reads a number from a parsed log line (0 if absent).
func num(v any) int64 {
	n, _ := v.(json.Number)
	i, _ := n.Int64()
	return i
}

// metric returns the value of the series name{labels} in reg, or -1 if
// the series does not exist.
func metric(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	if v, ok := testkit.Metric(t, reg, name, labels); ok {
		return v
	}
	return -1
}

func runs(t *testing.T, reg *prometheus.Registry, job, outcome string) float64 {
	t.Helper()
	return metric(t, reg, "job_runs_total", map[string]string{"job_name": job, "outcome": outcome})
}

// replica is one Scheduler with its own registry and log.
type replica struct {
	s   *Scheduler
	reg *prometheus.Registry
	log *testkit.LogBuffer
}

func startReplica(t *testing.T, opts Options, specs ...Spec) *replica {
	t.Helper()
	r := &replica{reg: prometheus.NewRegistry(), log: &testkit.LogBuffer{}}
	opts.Registerer = r.reg
	opts.Logger = r.log.Logger()
	if opts.InstanceID == "" {
		opts.InstanceID = "test"
	}
	s, err := New(opts, specs...)
	if err != nil {
		t.Fatal(err)
	}
	r.s = s
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	return r
}

func inProcess() lock.Locker { return lock.NewInProcess("test", nil) }

// runContext returns the context of a run of job name that holds lease
// job:<name> from locker, as the scheduler gives it to Run.
func runContext(t *testing.T, locker lock.Locker, name string) (context.Context, lock.Lease, *runInfo) {
	t.Helper()
	lease, err := locker.TryAcquire(context.Background(), lock.JobKey(name), 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lease.Release(context.Background()) })
	ctx, ri := withRun(context.Background(), lease, "run-"+name)
	return ctx, lease, ri
}

// postgresLocker is a PostgreSQL lock provider on db, closed with t.
func postgresLocker(t *testing.T, db *pgtest.DB, opts ...lock.Option) *lock.Postgres {
	t.Helper()
	pg, err := lock.NewPostgres(db.Pool, "test", nil, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	return pg
}

// state reads one job_state row.
func state(t *testing.T, pool *pgxpool.Pool, name string) Status {
	t.Helper()
	list, err := List(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("job %q not in job_state", name)
	return Status{}
}

// blocker is a job that runs until released or cancelled.
type blocker struct {
	name    string
	started chan int64 // fencing token of each run that started
	release chan struct{}
}

func newBlocker(name string) *blocker {
	return &blocker{name: name, started: make(chan int64, 16), release: make(chan struct{})}
}

func (b *blocker) Name() string { return b.name }

func (b *blocker) Run(ctx context.Context) error {
	tok, _ := FencingToken(ctx)
	b.started <- tok
	select {
	case <-b.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
