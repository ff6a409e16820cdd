package tasks

import (
	"bytes"
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
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

// A task that stopped for good without succeeding says why: its attempts
// ran out (discarded), its run failed with a permanent error (cancelled by
// River), or an operator cancelled it (cancelled too, marked by River's
// cancel_attempted_at).
func TestTaskListSaysWhyATaskStopped(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	a, err := NewAdmin(db.Pool, (&testkit.LogBuffer{}).Logger())
	if err != nil {
		t.Fatal(err)
	}
	exhausted := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	permanent := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	operator := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	waiting := enqueueSQL(t, db.Pool, "report", `{}`, `{}`)
	// What River writes when a last attempt fails, and when a run returns
	// river.JobCancel.
	for id, state := range map[int64]string{exhausted: "discarded", permanent: "cancelled"} {
		if _, err := db.Pool.Exec(ctx, `UPDATE river_job SET state = $2, attempt = 1, attempted_at = now(), finalized_at = now(),
			errors = array['{"at": "2026-01-01T00:00:00Z", "attempt": 1, "error": "boom"}'::jsonb] WHERE id = $1`, id, state); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.Cancel(ctx, operator, "ops"); err != nil {
		t.Fatal(err)
	}
	all, err := a.List(ctx, Filter{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]string{exhausted: ReasonAttemptsExhausted, permanent: ReasonPermanentError, operator: ReasonOperatorCancel, waiting: ""}
	for _, task := range all {
		if task.Reason != want[task.ID] {
			t.Errorf("task %d (%s): reason %q, want %q", task.ID, task.State, task.Reason, want[task.ID])
		}
	}
	dead, err := a.List(ctx, Filter{Dead: true, Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 2 {
		t.Fatalf("dead list: %+v; want the exhausted and the permanent one", dead)
	}
	var table bytes.Buffer
	if err := PrintTable(&table, all); err != nil {
		t.Fatal(err)
	}
	for _, r := range []string{"REASON", ReasonAttemptsExhausted, ReasonPermanentError, ReasonOperatorCancel} {
		if !strings.Contains(table.String(), r) {
			t.Errorf("table lacks %q:\n%s", r, table.String())
		}
	}
}
