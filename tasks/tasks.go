// Package tasks enqueues the worker's background tasks from Go, in the
// caller's own transaction.
//
// Tasks are River jobs: a Go task kind is a river.Worker[T] added to an
// embedding program with worker.WithTaskKind, and its args type T is what
// Enqueue takes. Configured kinds (http, sql) and other languages enqueue
// through SQL (docs/tasks.md).
package tasks

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	itasks "github.com/worker-dev/worker/internal/tasks"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// Enqueue inserts a task in tx through River's InsertTx: it becomes
// visible, and runs, once tx commits, and never if tx rolls back.
//
// The queue and max_attempts default to the kind's configuration
// (tasks.kinds); opts and the args' own InsertOpts win. When the queue's
// backlog is at its max_backlog the task is refused with a
// *RejectedError, and a kind name River cannot run is a *KindNameError.
// opts may be nil.
func Enqueue(ctx context.Context, tx pgx.Tx, args river.JobArgs, opts *river.InsertOpts) (*rivertype.JobInsertResult, error) {
	res, err := itasks.Enqueue(ctx, tx, args, opts)
	var (
		rejected *itasks.RejectedError
		badName  *tasksconfig.KindNameError
	)
	switch {
	case errors.As(err, &rejected):
		return nil, &RejectedError{Msg: rejected.Msg}
	case errors.As(err, &badName):
		return nil, &KindNameError{Name: badName.Name, msg: badName.Error()}
	}
	return res, err
}

// RejectedError is an enqueue refused because the queue's backlog is at
// its max_backlog (error code JOB_EXECUTOR_REJECTED). The statement failed,
// so tx is aborted: roll it back and retry later.
type RejectedError struct {
	Msg string // the database's message, naming the queue and its max_backlog
}

// Error is Msg.
func (e *RejectedError) Error() string { return e.Msg }

// KindNameError is a task kind name River refuses (the args' Kind()): a kind
// River could never run or store.
type KindNameError struct {
	Name string // the kind name
	msg  string
}

// Error names the kind and River's rule for kind names.
func (e *KindNameError) Error() string { return e.msg }
