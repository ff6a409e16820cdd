package tasks

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// RejectedError is an enqueue refused because the queue's available backlog
// is at its max_backlog: JOB_EXECUTOR_REJECTED. The producer's transaction
// is aborted, like any failed statement; retry it later.
type RejectedError struct{ Msg string }

func (e *RejectedError) Error() string { return e.Msg }

// Code implements obs.Coded.
func (e *RejectedError) Code() string { return obs.CodeJobExecutorRejected }

// rejectedState is the SQLSTATE worker_task_admit raises for a full queue.
const rejectedState = "WK001"

// inserter is an insert-only River client: no pool, no workers. InsertTx
// runs on the caller's transaction. An enqueue through it is traced
// (insertTracing).
var inserter = sync.OnceValues(func() (*river.Client[pgx.Tx], error) {
	return river.NewClient(riverpgxv5.New(nil), &river.Config{Logger: slog.New(slog.DiscardHandler),
		Middleware: []rivertype.Middleware{insertTracing()}})
})

// sinkInserter is inserter without tracing, for the river outbox sink:
// each task's metadata already carries its event's publish span, which an
// insert span of the whole batch would replace.
var sinkInserter = sync.OnceValues(func() (*river.Client[pgx.Tx], error) {
	return river.NewClient(riverpgxv5.New(nil), &river.Config{Logger: slog.New(slog.DiscardHandler)})
})

// Enqueue inserts a task in the caller's transaction, through River's
// InsertTx: it runs once tx commits. A kind name River refuses is a
// *KindNameError. Queue and max_attempts default to the
// kind's configuration (opts and the args' InsertOpts win), the queue's
// backlog bound applies (*RejectedError), and the Meta in ctx (WithMeta) is
// copied into the task's metadata.
func Enqueue(ctx context.Context, tx pgx.Tx, args river.JobArgs, opts *river.InsertOpts) (*rivertype.JobInsertResult, error) {
	if err := tasksconfig.CheckKindName(args.Kind()); err != nil {
		return nil, err
	}
	client, err := inserter()
	if err != nil {
		return nil, err
	}
	o := river.InsertOpts{}
	if opts != nil {
		o = *opts
	}
	if a, ok := args.(river.JobArgsWithInsertOpts); ok {
		own := a.InsertOpts()
		o.Queue = cmp.Or(o.Queue, own.Queue)
		o.MaxAttempts = cmp.Or(o.MaxAttempts, own.MaxAttempts)
	}
	err = tx.QueryRow(ctx, "SELECT queue, max_attempts FROM worker_task_admit($1, $2, $3)",
		args.Kind(), o.Queue, o.MaxAttempts).Scan(&o.Queue, &o.MaxAttempts)
	if err != nil {
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == rejectedState {
			return nil, &RejectedError{Msg: pg.Message}
		}
		return nil, err
	}
	if o.Metadata, err = MetaFrom(ctx).traced(ctx).mergeInto(o.Metadata); err != nil {
		return nil, err
	}
	return client.InsertTx(ctx, tx, args, &o)
}

// EnqueueJSON enqueues a task of a kind given by name, with args as JSON:
// for configured (http, sql) kinds, the CLI, and Go code that has no args
// type at hand.
func EnqueueJSON(ctx context.Context, tx pgx.Tx, kind string, args json.RawMessage, opts *river.InsertOpts) (*rivertype.JobInsertResult, error) {
	return Enqueue(ctx, tx, rawArgs{kind: kind, raw: args}, opts)
}

// KnownKind reports whether a replica that runs tasks has published kind
// (configured under tasks.kinds or registered in Go) into worker_task_kind.
// A task of a kind no replica knows waits for ever.
func KnownKind(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, kind string) (bool, error) {
	var known bool
	err := db.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM worker_task_kind WHERE kind = $1 AND kind <> '*')", kind).Scan(&known)
	return known, err
}

// EventArgs are the args of a task made from an outbox event. A Go task
// kind reads them by embedding EventArgs in its args type.
type EventArgs struct {
	EventID       string            `json:"event_id"`
	EventType     string            `json:"event_type"`
	AggregateType string            `json:"aggregate_type"`
	AggregateID   string            `json:"aggregate_id"`
	Payload       json.RawMessage   `json:"payload"`
	Headers       map[string]string `json:"headers,omitempty"`
	OccurredAt    time.Time         `json:"occurred_at"`
}

// InsertParams is the River insert of a task of kind k with args (a JSON
// object) and the propagated context m, for a caller that inserts many
// tasks at once: the outbox's river sink.
func InsertParams(k tasksconfig.Kind, args json.RawMessage, m Meta) (river.InsertManyParams, error) {
	meta, err := m.mergeInto(nil)
	if err != nil {
		return river.InsertManyParams{}, err
	}
	return river.InsertManyParams{
		Args:       rawArgs{kind: k.Name, raw: args},
		InsertOpts: &river.InsertOpts{Queue: k.Queue, MaxAttempts: k.MaxAttempts, Metadata: meta},
	}, nil
}

// InsertManyTx inserts params in tx through River's InsertManyTx, for the
// river outbox sink: untraced (sinkInserter), since each task's metadata
// carries its event's publish span already.
func InsertManyTx(ctx context.Context, tx pgx.Tx, params []river.InsertManyParams) error {
	client, err := sinkInserter()
	if err != nil {
		return err
	}
	_, err = client.InsertManyTx(ctx, tx, params)
	return err
}
