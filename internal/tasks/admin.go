package tasks

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
)

// Dead letters are the tasks that will not run again by themselves:
// discarded (the last attempt failed) or cancelled by a permanent error.
// A task an operator cancelled is cancelled too, but River marks it with
// cancel_attempted_at; it is not a dead letter.
var deadStates = []rivertype.JobState{rivertype.JobStateDiscarded, rivertype.JobStateCancelled}

const notOperatorCancelled = "NOT (metadata ? 'cancel_attempted_at')"

// Why a task stopped for good without succeeding: Task.Reason.
const (
	ReasonAttemptsExhausted = "attempts_exhausted" // discarded: its last attempt failed
	ReasonPermanentError    = "permanent_error"    // cancelled by its own run: the error was permanent
	ReasonOperatorCancel    = "operator_cancel"    // cancelled by an operator (CLI, River UI, JobCancel)
)

// reason tells the three ways a task ends without success apart. River
// records an operator's cancel (JobCancel, which the CLI and River UI call)
// as cancel_attempted_at in the task's metadata; a cancel by a permanent
// error leaves none and has that error as its last.
func reason(j *rivertype.JobRow) string {
	switch j.State {
	case rivertype.JobStateDiscarded:
		return ReasonAttemptsExhausted
	case rivertype.JobStateCancelled:
		var md struct {
			CancelAttemptedAt any `json:"cancel_attempted_at"`
		}
		if json.Unmarshal(j.Metadata, &md) == nil && md.CancelAttemptedAt != nil {
			return ReasonOperatorCancel
		}
		return ReasonPermanentError
	}
	return ""
}

// ErrNotFound is a task id that does not exist.
var ErrNotFound = errors.New("no such task")

// Admin runs the operator commands through River's own API.
type Admin struct {
	client *river.Client[pgx.Tx]
	log    *slog.Logger
}

// NewAdmin returns an Admin on pool; log receives the audit lines.
func NewAdmin(pool *pgxpool.Pool, log *slog.Logger) (*Admin, error) {
	c, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: log})
	if err != nil {
		return nil, err
	}
	return &Admin{client: c, log: log}, nil
}

// Task is one task as the CLI shows it, and its JSON is what
// `worker tasks list --output json` prints of it (docs/operations.md shows
// it). Every key is always present.
type Task struct {
	ID          int64           `json:"id"`
	Kind        string          `json:"kind"`
	Queue       string          `json:"queue"`
	State       string          `json:"state"`
	Attempt     int             `json:"attempt"`
	MaxAttempts int             `json:"max_attempts"`
	CreatedAt   time.Time       `json:"created_at"`
	ScheduledAt time.Time       `json:"scheduled_at"`
	FinalizedAt *time.Time      `json:"finalized_at"` // null until it finishes
	Args        json.RawMessage `json:"args"`
	Metadata    json.RawMessage `json:"metadata"`
	LastError   string          `json:"last_error"`
	// Reason says why a discarded or cancelled task stopped: one of the
	// Reason* constants.
	Reason string `json:"reason"`
}

func toTask(j *rivertype.JobRow) Task {
	t := Task{ID: j.ID, Kind: j.Kind, Queue: j.Queue, State: string(j.State), Attempt: j.Attempt,
		MaxAttempts: j.MaxAttempts, CreatedAt: j.CreatedAt, ScheduledAt: j.ScheduledAt, FinalizedAt: j.FinalizedAt,
		Args: j.EncodedArgs, Metadata: j.Metadata, Reason: reason(j)}
	if n := len(j.Errors); n > 0 {
		t.LastError = j.Errors[n-1].Error
	}
	return t
}

// Filter selects tasks for List.
type Filter struct {
	State string // a River state, or "" for any
	Kind  string // "" for any
	Dead  bool   // dead letters only
	Limit int
}

// List returns tasks, newest first.
func (a *Admin) List(ctx context.Context, f Filter) ([]Task, error) {
	p := river.NewJobListParams().OrderBy(river.JobListOrderByID, river.SortOrderDesc).First(max(f.Limit, 1))
	switch {
	case f.Dead:
		p = p.States(deadStates...).Where(notOperatorCancelled)
	case f.State != "":
		if err := CheckState(f.State); err != nil {
			return nil, err
		}
		p = p.States(rivertype.JobState(f.State))
	default:
		p = p.States(rivertype.JobStates()...)
	}
	if f.Kind != "" {
		p = p.Kinds(f.Kind)
	}
	res, err := a.client.JobList(ctx, p)
	if err != nil {
		return nil, err
	}
	out := make([]Task, len(res.Jobs))
	for i, j := range res.Jobs {
		out[i] = toTask(j)
	}
	return out, nil
}

// Retry makes a task available to run again now, with its attempts kept
// (River adds one more allowed attempt if it had none left).
func (a *Admin) Retry(ctx context.Context, id int64, who string) (Task, error) {
	j, err := a.client.JobRetry(ctx, id)
	if err != nil {
		return Task{}, notFound(err, id)
	}
	log := a.log.With("task_id", id, "task_kind", j.Kind, "state", string(j.State), "operator", who)
	if j.State == rivertype.JobStateRunning {
		// River leaves a running task alone; saying "retried" would send
		// the operator looking for a second run that never comes.
		log.Warn("task not retried: it is running")
	} else {
		log.Info("task retried by an operator")
	}
	return toTask(j), nil
}

// RetryAllDead retries every dead letter and returns how many.
func (a *Admin) RetryAllDead(ctx context.Context, who string) (int, error) {
	n := 0
	for {
		dead, err := a.List(ctx, Filter{Dead: true, Limit: 500})
		if err != nil || len(dead) == 0 {
			return n, err
		}
		retried := 0
		for _, t := range dead {
			_, err := a.Retry(ctx, t.ID, who)
			switch {
			case err == nil:
				retried++
			case !errors.Is(err, ErrNotFound): // deleted meanwhile: nothing to retry
				return n + retried, err
			}
		}
		n += retried
		if retried == 0 {
			return n, nil
		}
	}
}

// Cancel cancels a task: at once if it waits, or by cancelling its run's
// context if it runs (the replica running it is told through LISTEN). A
// task that already completed or was discarded is left as it is, and the
// log line says so rather than claiming a cancel.
func (a *Admin) Cancel(ctx context.Context, id int64, who string) (Task, error) {
	j, err := a.client.JobCancel(ctx, id)
	if err != nil {
		return Task{}, notFound(err, id)
	}
	log := a.log.With("task_id", id, "task_kind", j.Kind, "state", string(j.State), "operator", who)
	switch j.State {
	case rivertype.JobStateCancelled:
		log.Info("task cancelled by an operator")
	case rivertype.JobStateRunning:
		log.Info("task cancel requested by an operator; the replica running it cancels the run")
	default:
		log.Warn("task not cancelled: it has already finished")
	}
	return toTask(j), nil
}

func notFound(err error, id int64) error {
	if errors.Is(err, rivertype.ErrNotFound) {
		return fmt.Errorf("task %d: %w", id, ErrNotFound)
	}
	return err
}

// PrintTable writes tasks as a table. With --output json the CLI prints
// the []Task itself.
func PrintTable(w io.Writer, list []Task) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tKIND\tQUEUE\tSTATE\tREASON\tATTEMPT\tCREATED\tLAST ERROR")
	for _, t := range list {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d/%d\t%s\t%s\n", t.ID, t.Kind, t.Queue, t.State, cmp.Or(t.Reason, "-"),
			t.Attempt, t.MaxAttempts, t.CreatedAt.UTC().Format(time.RFC3339), strings.Join(strings.Fields(t.LastError), " "))
	}
	return tw.Flush()
}

// CheckState returns an error naming River's states unless s is one.
func CheckState(s string) error {
	if slices.Contains(rivertype.JobStates(), rivertype.JobState(s)) {
		return nil
	}
	names := make([]string, len(states))
	for i, v := range states {
		names[i] = string(v)
	}
	return fmt.Errorf("state %q; want one of %s", s, strings.Join(names, ", "))
}
