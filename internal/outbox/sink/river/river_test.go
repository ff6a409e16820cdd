package river

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// startSinkRelay runs an outbox relay with the river sink for routes on db,
// shut down when the test ends.
func startSinkRelay(t *testing.T, db *pgtest.DB, cfg tasksconfig.Config, routes map[string]string) {
	t.Helper()
	sink, err := New(cfg, routes)
	if err != nil {
		t.Fatal(err)
	}
	ocfg := outboxconfig.DefaultConfig()
	ocfg.Sink, ocfg.River.Routes = "river", routes
	ocfg.PollInterval = 50 * time.Millisecond
	ocfg.BackoffBase, ocfg.BackoffMax = 10*time.Millisecond, 50*time.Millisecond
	ocfg.MaxAttempts = 1000
	logs := &testkit.LogBuffer{}
	r, err := outbox.NewRelay(db.Pool, sink, ocfg, "test-relay", logs.Logger(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := r.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
}

// appendEvents appends events in one transaction and returns their ids.
func appendEvents(t *testing.T, pool *pgxpool.Pool, events ...outbox.NewEvent) []string {
	t.Helper()
	var ids []string
	err := pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		for _, e := range events {
			id, err := outbox.Append(t.Context(), tx, e)
			if err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// recordPublishes records every publish from now on
// (outboxtest.RecordPublishes); the returned function reads the record:
// attempts by outbox_event id.
func recordPublishes(t *testing.T, pool *pgxpool.Pool) func() map[int64]int {
	t.Helper()
	outboxtest.RecordPublishes(t, pool)
	return func() map[int64]int {
		t.Helper()
		rows, err := pool.Query(t.Context(), "SELECT id, attempts FROM test_publish")
		if err != nil {
			t.Fatal(err)
		}
		got := map[int64]int{}
		var id int64
		var attempts int
		if _, err := pgx.ForEachRow(rows, []any{&id, &attempts}, func() error {
			if _, dup := got[id]; dup {
				return fmt.Errorf("delivery row %d deleted twice", id)
			}
			got[id] = attempts
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
}

func eventStatus(t *testing.T, pool *pgxpool.Pool, eventID string) (status, lastError string) {
	t.Helper()
	err := pool.QueryRow(t.Context(), "SELECT status, coalesce(last_error, '') FROM outbox_event_state WHERE event_id = $1", eventID).
		Scan(&status, &lastError)
	if err != nil {
		t.Fatal(err)
	}
	return status, lastError
}

func waitEventStatus(t *testing.T, pool *pgxpool.Pool, eventID, want string) string {
	t.Helper()
	var lastError string
	testkit.Eventually(t, 10*time.Second, "event "+eventID+" "+want, func() bool {
		var status string
		status, lastError = eventStatus(t, pool, eventID)
		return status == want
	})
	return lastError
}

type sinkTask struct {
	ID          int64
	Kind, Queue string
	MaxAttempts int
	Args        tasks.EventArgs
	Meta        tasks.Meta
}

// sinkTasks lists the tasks in insertion order.
func sinkTasks(t *testing.T, pool *pgxpool.Pool) []sinkTask {
	t.Helper()
	rows, err := pool.Query(t.Context(), "SELECT id, kind, queue, max_attempts, args, metadata FROM river_job ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []sinkTask
	for rows.Next() {
		var task sinkTask
		var args, meta []byte
		if err := rows.Scan(&task.ID, &task.Kind, &task.Queue, &task.MaxAttempts, &args, &meta); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(args, &task.Args); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(meta, &task.Meta); err != nil {
			t.Fatal(err)
		}
		out = append(out, task)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Each event becomes one task: the route of its type, or the "*" default,
// picks the kind, whose queue and max_attempts the task gets; the args carry
// the event and the metadata its propagated context. An aggregate's tasks
// are inserted in its order.
func TestOutboxSinkTurnsEventsIntoTasks(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	// mail is bounded, default is not: both kinds of queue admit tasks.
	cfg := testConfig(t, map[string]tasksconfig.Queue{"mail": queue(1, 100), tasksconfig.DefaultQueue: queue(1, 0)},
		tasksconfig.Kind{Name: "ship", Type: tasksconfig.TypeGo, Queue: "mail", MaxAttempts: 7},
		tasksconfig.Kind{Name: "audit", Type: tasksconfig.TypeGo})
	published := recordPublishes(t, db.Pool)
	occurred := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	ids := appendEvents(t, db.Pool,
		outbox.NewEvent{AggregateType: "order", AggregateID: "1", EventType: "order.created", Payload: json.RawMessage(`{"n": 1}`), OccurredAt: occurred},
		outbox.NewEvent{AggregateType: "order", AggregateID: "1", EventType: "order.shipped", Payload: json.RawMessage(`{"n": 2}`),
			Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant_id": "t-9"}, OccurredAt: occurred},
		outbox.NewEvent{AggregateType: "user", AggregateID: "u", EventType: "user.renamed", Payload: json.RawMessage(`[3]`), OccurredAt: occurred},
	)
	startSinkRelay(t, db, cfg, map[string]string{"order.shipped": "ship", "*": "audit"})
	for _, id := range ids {
		waitEventStatus(t, db.Pool, id, outbox.StatusPublished)
	}

	// The river sink writes in the claim transaction, so an event is never
	// detached: its delivery row is deleted by the batch that published it,
	// with attempts counting the failures before. Zero: the first try did.
	if got := published(); len(got) != len(ids) {
		t.Errorf("%d delivery rows deleted as published, want %d: %v", len(got), len(ids), got)
	} else {
		for id, attempts := range got {
			if attempts != 0 {
				t.Errorf("event %d was published after %d failed attempts, want the first to succeed", id, attempts)
			}
		}
	}
	got := sinkTasks(t, db.Pool)
	if len(got) != 3 {
		t.Fatalf("%d tasks, want 3: %+v", len(got), got)
	}
	byEvent := map[string]sinkTask{}
	for _, task := range got {
		byEvent[task.Args.EventID] = task
	}
	want := []struct {
		kind, queue string
		maxAttempts int
		args        tasks.EventArgs
	}{
		{"audit", tasksconfig.DefaultQueue, 3, tasks.EventArgs{EventID: ids[0], EventType: "order.created", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{"n": 1}`)}},
		{"ship", "mail", 7, tasks.EventArgs{EventID: ids[1], EventType: "order.shipped", AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{"n": 2}`),
			Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant_id": "t-9"}}},
		{"audit", tasksconfig.DefaultQueue, 3, tasks.EventArgs{EventID: ids[2], EventType: "user.renamed", AggregateType: "user", AggregateID: "u", Payload: json.RawMessage(`[3]`)}},
	}
	for _, w := range want {
		task, ok := byEvent[w.args.EventID]
		if !ok {
			t.Fatalf("no task for event %s: %+v", w.args.EventID, got)
		}
		if task.Kind != w.kind || task.Queue != w.queue || task.MaxAttempts != w.maxAttempts {
			t.Errorf("event %s: task kind %s queue %s max_attempts %d; want %s %s %d",
				w.args.EventType, task.Kind, task.Queue, task.MaxAttempts, w.kind, w.queue, w.maxAttempts)
		}
		w.args.OccurredAt = occurred
		gotArgs, _ := json.Marshal(task.Args)
		wantArgs, _ := json.Marshal(w.args)
		if string(gotArgs) != string(wantArgs) {
			t.Errorf("event %s: args\n%s\nwant\n%s", w.args.EventType, gotArgs, wantArgs)
		}
	}
	if m := byEvent[ids[1]].Meta; m.TenantID != "t-9" || m.TraceID != "0af7651916cd43dd8448eb211c80319c" {
		t.Errorf("metadata %+v; want the event's tenant_id and trace", m)
	}
	if byEvent[ids[0]].ID > byEvent[ids[1]].ID {
		t.Error("order 1's tasks were inserted out of its order")
	}
}

// An event whose queue is at its max_backlog is refused like any enqueue
// (JOB_EXECUTOR_REJECTED), a transient failure: it retries with the outbox
// backoff, the later events of its aggregate wait behind it, and it goes
// through once the queue has room.
func TestOutboxSinkFullQueueRetriesTheEvent(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := testConfig(t, map[string]tasksconfig.Queue{"tiny": queue(1, 1)},
		tasksconfig.Kind{Name: "slow", Type: tasksconfig.TypeGo, Queue: "tiny"})
	routes := map[string]string{"*": "slow"}
	first := appendEvents(t, db.Pool, outbox.NewEvent{AggregateType: "a", AggregateID: "1", EventType: "e", Payload: json.RawMessage(`{}`)})
	startSinkRelay(t, db, cfg, routes)
	waitEventStatus(t, db.Pool, first[0], outbox.StatusPublished)

	held := appendEvents(t, db.Pool,
		outbox.NewEvent{AggregateType: "a", AggregateID: "2", EventType: "e", Payload: json.RawMessage(`{}`)},
		outbox.NewEvent{AggregateType: "a", AggregateID: "2", EventType: "e", Payload: json.RawMessage(`{}`)})
	lastError := waitEventStatus(t, db.Pool, held[0], outbox.StatusFailed)
	if !strings.Contains(lastError, "JOB_EXECUTOR_REJECTED") {
		t.Errorf("last_error %q; want JOB_EXECUTOR_REJECTED", lastError)
	}
	if status, _ := eventStatus(t, db.Pool, held[1]); status != outbox.StatusPending {
		t.Errorf("the next event of the refused one's aggregate is %s; want PENDING", status)
	}
	if n := len(sinkTasks(t, db.Pool)); n != 1 {
		t.Fatalf("%d tasks; want 1 (the queue's max_backlog)", n)
	}

	// The task is worked off: the queue has room again.
	if _, err := db.Pool.Exec(t.Context(), "DELETE FROM river_job"); err != nil {
		t.Fatal(err)
	}
	waitEventStatus(t, db.Pool, held[0], outbox.StatusPublished)
	if _, err := db.Pool.Exec(t.Context(), "DELETE FROM river_job"); err != nil {
		t.Fatal(err)
	}
	waitEventStatus(t, db.Pool, held[1], outbox.StatusPublished)
}

// A task insert that fails leaves its event unpublished: FAILED with the
// insert's error, to be retried.
func TestOutboxSinkFailedInsertLeavesEventUnpublished(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "audit", Type: tasksconfig.TypeGo})
	_, err := db.Pool.Exec(t.Context(), `
CREATE FUNCTION refuse_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'task insert refused'; END $$;
CREATE TRIGGER refuse_task BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION refuse_task();`)
	if err != nil {
		t.Fatal(err)
	}
	ids := appendEvents(t, db.Pool, outbox.NewEvent{AggregateType: "a", AggregateID: "1", EventType: "e", Payload: json.RawMessage(`{}`)})
	startSinkRelay(t, db, cfg, map[string]string{"*": "audit"})

	lastError := waitEventStatus(t, db.Pool, ids[0], outbox.StatusFailed)
	if !strings.Contains(lastError, "task insert refused") {
		t.Errorf("last_error %q; want the insert's error", lastError)
	}
	if _, err := db.Pool.Exec(t.Context(), "DROP TRIGGER refuse_task ON river_job"); err != nil {
		t.Fatal(err)
	}
	waitEventStatus(t, db.Pool, ids[0], outbox.StatusPublished)
	if tasks := sinkTasks(t, db.Pool); len(tasks) != 1 {
		t.Errorf("%d tasks; want 1", len(tasks))
	}
}

// The task insert and the PUBLISHED mark (deleting the event's delivery
// row) are one transaction: when the mark fails after the insert
// succeeded, no task is left behind.
func TestOutboxSinkFailedMarkLeavesNoTask(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "audit", Type: tasksconfig.TypeGo})
	// A sequence counts the refused marks: a rollback does not undo it.
	// Publishing is the only thing that deletes a delivery row that is not
	// DEAD, so the trigger refuses exactly the marks.
	_, err := db.Pool.Exec(t.Context(), `
CREATE SEQUENCE refused_marks;
CREATE FUNCTION refuse_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.dead_at IS NULL THEN
        PERFORM nextval('refused_marks');
        RAISE EXCEPTION 'mark refused';
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER refuse_mark BEFORE DELETE ON outbox_delivery FOR EACH ROW EXECUTE FUNCTION refuse_mark();`)
	if err != nil {
		t.Fatal(err)
	}
	ids := appendEvents(t, db.Pool, outbox.NewEvent{AggregateType: "a", AggregateID: "1", EventType: "e", Payload: json.RawMessage(`{}`)})
	startSinkRelay(t, db, cfg, map[string]string{"*": "audit"})

	testkit.Eventually(t, 10*time.Second, "three refused marks", func() bool {
		var n int64
		if err := db.Pool.QueryRow(t.Context(), "SELECT last_value FROM refused_marks").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n >= 3
	})
	if status, _ := eventStatus(t, db.Pool, ids[0]); status != outbox.StatusPending {
		t.Errorf("event is %s; want PENDING", status)
	}
	if tasks := sinkTasks(t, db.Pool); len(tasks) != 0 {
		t.Errorf("%d tasks exist; want none: the event was never marked published", len(tasks))
	}
}

// A route to a kind that is not configured is an error naming the key.
func TestOutboxSinkUnknownRouteTarget(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "audit", Type: tasksconfig.TypeGo})
	_, err := New(cfg, map[string]string{"order.shipped": "ship"})
	want := `outbox.river.routes.order.shipped="ship": no such kind under tasks.kinds (have audit)`
	if err == nil || err.Error() != want {
		t.Fatalf("error %v; want %s", err, want)
	}
}

// testConfig is a validated tasks configuration with queues and kinds,
// and short backoffs.
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
