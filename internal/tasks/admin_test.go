package tasks

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"

	"worker/internal/pgtest"
	"worker/internal/testkit"
)

// The audit lines of cancel and retry say what River did, which is nothing
// for a finished task (cancel) or a running one (retry).
func TestAdminLogsWhatCancelAndRetryDid(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	logs := &testkit.LogBuffer{}
	a, err := NewAdmin(db.Pool, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	// No runtime runs: the tasks stay where the test puts them.
	waiting := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	done := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	running := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	if _, err := db.Pool.Exec(ctx, `UPDATE river_job SET state = 'completed', finalized_at = now() WHERE id = $1`, done); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1`, running); err != nil {
		t.Fatal(err)
	}

	if task, err := a.Cancel(ctx, waiting, "ops"); err != nil || task.State != "cancelled" {
		t.Fatalf("cancel of a waiting task: %+v, %v", task, err)
	}
	if task, err := a.Cancel(ctx, done, "ops"); err != nil || task.State != "completed" {
		t.Fatalf("cancel of a completed task: %+v, %v", task, err)
	}
	if task, err := a.Retry(ctx, running, "ops"); err != nil || task.State != "running" {
		t.Fatalf("retry of a running task: %+v, %v", task, err)
	}

	cancelled := logs.Lines(t, "task cancelled by an operator")
	if len(cancelled) != 1 || cancelled[0]["task_id"] != idNumber(waiting) {
		t.Fatalf("\"task cancelled\" lines: %v; want one, for task %d", cancelled, waiting)
	}
	if l := logs.Lines(t, "task not cancelled: it has already finished"); len(l) != 1 || l[0]["task_id"] != idNumber(done) {
		t.Fatalf("\"not cancelled\" lines: %v; want one, for task %d", l, done)
	}
	if l := logs.Lines(t, "task retried by an operator"); len(l) != 0 {
		t.Fatalf("a running task was logged as retried: %v", l)
	}
	if l := logs.Lines(t, "task not retried: it is running"); len(l) != 1 || l[0]["task_id"] != idNumber(running) {
		t.Fatalf("\"not retried\" lines: %v; want one, for task %d", l, running)
	}
}

// idNumber is a task id as testkit.LogBuffer.Lines decodes it.
func idNumber(id int64) json.Number { return json.Number(strconv.FormatInt(id, 10)) }
