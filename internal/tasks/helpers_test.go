package tasks

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// testConfig is DefaultConfig with fast retries, validated with queues
// (besides the default one) and kinds.
func testConfig(t testing.TB, queues map[string]tasksconfig.Queue, kinds ...tasksconfig.Kind) tasksconfig.Config {
	t.Helper()
	cfg := tasksconfig.DefaultConfig()
	cfg.Queues = queues
	cfg.BackoffBase = 10 * time.Millisecond
	cfg.BackoffMax = 50 * time.Millisecond
	cfg.MetricsInterval = 50 * time.Millisecond
	cfg.Kinds = kinds
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// queue is a queue's configuration with both keys written.
func queue(maxWorkers, maxBacklog int) tasksconfig.Queue {
	return tasksconfig.Queue{MaxWorkers: &maxWorkers, MaxBacklog: &maxBacklog}
}

// harness is a started Runtime on a private database.
type harness struct {
	db   *pgtest.DB
	rt   *Runtime
	reg  *prometheus.Registry
	logs *testkit.LogBuffer
}

// start runs a Runtime for cfg on db, shut down when the test ends.
func start(t *testing.T, db *pgtest.DB, cfg tasksconfig.Config, register func(*Registry) error) *harness {
	t.Helper()
	h := &harness{db: db, reg: prometheus.NewRegistry(), logs: &testkit.LogBuffer{}}
	rt, err := New(Options{Config: cfg, Pool: db.Pool, InstanceID: "test", Logger: h.logs.Logger(),
		Registerer: h.reg, Register: register})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.rt = rt
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = rt.Shutdown(ctx)
	})
	return h
}

// enqueueSQL enqueues through the SQL function in its own transaction.
func enqueueSQL(t testing.TB, pool *pgxpool.Pool, kind, args, metadata string) int64 {
	t.Helper()
	var id int64
	if err := pool.QueryRow(context.Background(), "SELECT worker_enqueue($1, $2::jsonb, metadata => $3::jsonb)",
		kind, args, metadata).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// enqueueGo enqueues through Enqueue in its own transaction.
func enqueueGo(t testing.TB, ctx context.Context, pool *pgxpool.Pool, kind, args string) int64 {
	t.Helper()
	var id int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := EnqueueJSON(ctx, tx, kind, json.RawMessage(args), nil)
		if err == nil {
			id = res.Job.ID
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

type taskRow struct {
	State       string
	Attempt     int
	Errors      int
	ScheduledAt time.Time
}

func rowOf(t testing.TB, pool *pgxpool.Pool, id int64) taskRow {
	t.Helper()
	var r taskRow
	err := pool.QueryRow(context.Background(),
		"SELECT state::text, attempt, coalesce(array_length(errors, 1), 0), scheduled_at FROM river_job WHERE id = $1", id).
		Scan(&r.State, &r.Attempt, &r.Errors, &r.ScheduledAt)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// waitState polls until task id is in state.
func waitState(t testing.TB, pool *pgxpool.Pool, id int64, state string, within time.Duration) taskRow {
	t.Helper()
	var r taskRow
	testkit.Eventually(t, within, "task in state "+state, func() bool {
		r = rowOf(t, pool, id)
		return r.State == state
	})
	return r
}

func metric(t testing.TB, h *harness, name string, labels map[string]string) float64 {
	t.Helper()
	v, ok := testkit.Metric(t, h.reg, name, labels)
	if !ok {
		t.Fatalf("no series %s%v", name, labels)
	}
	return v
}
