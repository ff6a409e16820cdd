package worker_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker"
	"github.com/worker-dev/worker/outbox"
)

// A program that embeds the worker: the stock daemon plus one Go job, one
// Go task kind and one custom sink.
func ExampleRun() {
	code := worker.Run(os.Args[1:],
		worker.WithJob(worker.Job{Name: "close-stale-carts", Delay: time.Minute, Run: closeStaleCarts}),
		worker.WithTaskKind(&ReceiptWorker{}),
		worker.WithSink("audit", func(ctx context.Context) (outbox.Sink, error) { return auditSink{}, nil }),
	)
	os.Exit(code)
}

// A Go job that writes through InTx: its transaction commits only while
// the job's lease is held.
func ExampleInTx() {
	_ = worker.Job{
		Name:  "close-stale-carts",
		Delay: time.Minute,
		Run: func(ctx context.Context) error {
			return worker.InTx(ctx, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "UPDATE cart SET closed = true WHERE updated_at < now() - interval '1 day'")
				return err
			})
		},
	}
}

// InTx refuses a context that is not a job run's: there is no lease to
// fence the transaction with.
func ExampleInTx_outsideAJob() {
	err := worker.InTx(context.Background(), func(pgx.Tx) error { return nil })
	fmt.Println(err)
	// Output: worker: InTx needs the context of a Go job's run, whose lease fences the transaction
}

// A Go task kind is a river.Worker for an args type.
func ExampleWithTaskKind() {
	_ = worker.WithTaskKind(&ReceiptWorker{})
}

// The commit outcome of a broken connection is reported apart.
func ExampleErrCommitUnknown() {
	err := fmt.Errorf("close carts: %w", worker.ErrCommitUnknown)
	fmt.Println(errors.Is(err, worker.ErrCommitUnknown))
	// Output: true
}

func closeStaleCarts(ctx context.Context) error {
	return worker.InTx(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE cart SET closed = true WHERE updated_at < now() - interval '1 day'")
		return err
	})
}

type ReceiptArgs struct {
	OrderID int64 `json:"order_id"`
}

func (ReceiptArgs) Kind() string { return "send-receipt" }

type ReceiptWorker struct {
	river.WorkerDefaults[ReceiptArgs]
}

func (*ReceiptWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	return nil // send the receipt for job.Args.OrderID
}

type auditSink struct{}

func (auditSink) Name() string { return "audit" }

func (auditSink) Publish(ctx context.Context, m outbox.Message) error {
	return nil // write m to the audit store
}

// A Go job runs on a fixed delay, one replica at a time cluster-wide.
func ExampleWithJob() {
	_ = worker.WithJob(worker.Job{
		Name:    "close-stale-carts",
		Delay:   time.Minute,
		Timeout: 30 * time.Second,
		Run:     closeStaleCarts,
	})
}

// A custom sink is selected with APP_OUTBOX_SINK=audit.
func ExampleWithSink() {
	_ = worker.WithSink("audit", func(ctx context.Context) (outbox.Sink, error) {
		return auditSink{}, nil // connect to the audit store here
	})
}
