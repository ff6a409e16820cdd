package startup_test

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/startup"
	"github.com/worker-dev/worker/internal/testkit"
)

const riverSinkTasks = `
tasks:
  kinds:
    - {name: ship, type: sql, sql: SELECT 1}
    - {name: audit, type: sql, sql: SELECT 1}
`

func configPath(t *testing.T, yaml string) string {
	return strings.TrimPrefix(writeConfig(t, yaml), "APP_CONFIG_FILE=")
}

// Routes are keyed by event type, which has dots: they must arrive whole.
func TestRiverSinkRoutesKeepDottedEventTypes(t *testing.T) {
	t.Parallel()
	cfg, err := startup.LoadConfig(configPath(t, `
outbox:
  sink: river
  river:
    routes:
      order.shipped: ship
      "*": audit
`+riverSinkTasks), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"order.shipped": "ship", "*": "audit"}
	if !maps.Equal(cfg.Outbox.River.Routes, want) {
		t.Fatalf("routes %v; want %v", cfg.Outbox.River.Routes, want)
	}
}

// A route to a kind that tasks.kinds does not have, or no route at all, is
// a configuration error naming the key.
func TestRiverSinkRouteErrorsExit78(t *testing.T) {
	t.Parallel()
	for yaml, want := range map[string]string{
		"outbox:\n  sink: river\n  river:\n    routes:\n      order.shipped: shipping\n" + riverSinkTasks: `outbox.river.routes.order.shipped="shipping": no such kind under tasks.kinds (have ship, audit)`,
		"outbox:\n  sink: river\n" + riverSinkTasks:                                                       "outbox.river.routes is empty",
	} {
		_, err := startup.LoadConfig(configPath(t, yaml), nil)
		if startup.ExitCode(err) != startup.ExitConfig || !strings.Contains(err.Error(), want) {
			t.Errorf("got exit %d: %v; want 78 with %q", startup.ExitCode(err), err, want)
		}
	}
}

// The test of the exactly-once hand-off: the relay process is
// SIGKILLed three times while 10,000 events flow, and every event becomes
// exactly one task, each aggregate's inserted in its order.
func TestRiverSinkExactlyOnceAcrossSIGKILL(t *testing.T) {
	t.Parallel()
	const events, perTx, aggregates = 10000, 100, 50
	db := pgtest.New(t)
	env := []string{
		"APP_DATABASE_URL=" + db.URL, "APP_LOG_LEVEL=info", "APP_TASKS_ENABLED=false",
		"APP_OUTBOX_BATCH_SIZE=100", "APP_OUTBOX_RELAYS=2",
		writeConfig(t, `
outbox:
  sink: river
  river:
    routes: {"*": audit}
tasks:
  queues:
    default: {max_workers: 1, max_backlog: 0}
  kinds:
    - {name: audit, type: sql, sql: SELECT 1}
`),
	}
	ctx := t.Context()
	count := func(sql string) int {
		t.Helper()
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	w := startWorker(t, env)
	w.waitReady(t, 30*time.Second)
	// The producer appends while the relay is killed and restarted, at a
	// pace that leaves every kill events to interrupt.
	produced := make(chan error, 1)
	go func() {
		tick := time.NewTicker(25 * time.Millisecond)
		defer tick.Stop()
		for i := 0; i < events; i += perTx {
			<-tick.C
			_, err := db.Pool.Exec(context.Background(), `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', (n % $2)::text, 'order.created', jsonb_build_object('n', n)
FROM generate_series($1::int, $1::int + $3 - 1) AS n`, i, aggregates, perTx)
			if err != nil {
				produced <- err
				return
			}
		}
		produced <- nil
	}()

	for kill, after := range []int{1500, 4000, 6500} {
		testkit.Eventually(t, 30*time.Second, fmt.Sprintf("%d tasks before kill %d", after, kill+1), func() bool {
			return count("SELECT count(*) FROM river_job") >= after
		})
		if err := w.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		w.exitCode(t, 10*time.Second)
		w = startWorker(t, env)
		w.waitReady(t, 30*time.Second)
	}
	if err := <-produced; err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "every event published", func() bool {
		return count("SELECT count(*) FROM outbox_event_state WHERE status = 'PUBLISHED'") == events
	})

	if n := count("SELECT count(*) FROM river_job"); n != events {
		t.Errorf("%d tasks; want exactly %d", n, events)
	}
	if n := count("SELECT count(*) - count(DISTINCT args->>'event_id') FROM river_job"); n != 0 {
		t.Errorf("%d tasks for an event that already had one", n)
	}
	if n := count(`SELECT count(*) FROM outbox_event e
	               LEFT JOIN river_job j ON j.args->>'event_id' = e.event_id::text WHERE j.id IS NULL`); n != 0 {
		t.Errorf("%d events without a task", n)
	}
	// Each aggregate's tasks were inserted in its events' order.
	if n := count(`SELECT count(*) FROM (
	                   SELECT e.id < lag(e.id) OVER (PARTITION BY e.aggregate_id ORDER BY j.id) AS backwards
	                   FROM river_job j JOIN outbox_event e ON e.event_id::text = j.args->>'event_id') o
	               WHERE backwards`); n != 0 {
		t.Errorf("%d tasks inserted before an earlier event of their aggregate", n)
	}
}
