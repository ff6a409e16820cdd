// Package worker embeds the worker daemon in a Go program: the same
// daemon as the stock binary (scheduled jobs with distributed leases, the
// transactional-outbox relay, River background tasks), plus Go jobs, Go
// task kinds and custom outbox sinks.
//
// A program's main is
//
//	func main() {
//		os.Exit(worker.Run(os.Args[1:],
//			worker.WithJob(worker.Job{Name: "refresh-report", Delay: time.Minute, Run: refresh}),
//			worker.WithTaskKind(&SendReceiptWorker{}),
//			worker.WithSink("audit", newAuditSink),
//		))
//	}
//
// Everything else (configuration, exit codes, signals, the ops HTTP
// server, the operator commands) is the stock binary's: docs/embedding.md
// says when to embed and when to run the stock binary. Producers write
// events and tasks with the outbox and tasks packages.
package worker

import (
	"context"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker/inbox"
	"github.com/worker-dev/worker/internal/cli"
	iinbox "github.com/worker-dev/worker/internal/inbox"
	ijobs "github.com/worker-dev/worker/internal/jobs"
	ioutbox "github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/startup"
	itasks "github.com/worker-dev/worker/internal/tasks"
	"github.com/worker-dev/worker/outbox"
)

// Run runs the worker with the command line args (os.Args[1:] in a main)
// exactly as cmd/worker does: the same commands, configuration
// (configs/worker.yaml and APP_* variables), SIGTERM and SIGINT handling,
// and logs. It returns the process's exit code (0 for a clean shutdown,
// 78 for invalid configuration, and so on; see docs/operations.md), for os.Exit.
// opts add Go jobs, Go task kinds and outbox sinks.
func Run(args []string, opts ...Option) int {
	var ext startup.Extensions
	for _, o := range opts {
		o.apply(&ext)
	}
	return cli.MainWith(ext, args, os.Stdout, os.Stderr, os.Environ())
}

// Option adds a Go job, a Go task kind or an outbox sink to Run.
type Option struct {
	apply func(*startup.Extensions)
}

// Job is a scheduled job written in Go. It runs like a configured job: on a
// fixed delay, never overlapping itself, and, with
// APP_MULTI_INSTANCE_ENABLED=true, under the lease job:<Name>, so that one
// replica at a time runs it cluster-wide.
type Job struct {
	// Name identifies the job in logs, metrics and its lease. Required,
	// unique among all jobs.
	Name string
	// Delay is the rest between the end of one run and the start of the
	// next, cluster-wide. Required.
	Delay time.Duration
	// InitialDelay holds this replica's first run back after start.
	InitialDelay time.Duration
	// Timeout bounds one run; 0 means 5 minutes.
	Timeout time.Duration
	// LeaseTTL is the ttl of the job's lease; 0 means lock.lease_ttl.
	LeaseTTL time.Duration
	// Run does one run. ctx is cancelled when the run times out, when its
	// lease is lost, and at the end of the shutdown budget. A job that
	// writes to the worker's database does so through InTx.
	Run func(ctx context.Context) error
}

// WithJob adds a Go job. A job without a Name, Delay or Run stops Run at
// once with exit code 78, naming the mistake.
func WithJob(j Job) Option {
	return Option{func(x *startup.Extensions) {
		prev := x.Jobs
		x.Jobs = func(pool *pgxpool.Pool) []ijobs.Spec {
			var specs []ijobs.Spec
			if prev != nil {
				specs = prev(pool)
			}
			spec := ijobs.Spec{Delay: j.Delay, InitialDelay: j.InitialDelay, Timeout: j.Timeout, LeaseTTL: j.LeaseTTL}
			if j.Run != nil { // else refused at start: the spec has no job
				spec.Job = ijobs.Func(j.Name, func(ctx context.Context) error { return j.Run(context.WithValue(ctx, poolKey{}, pool)) })
			}
			return append(specs, spec)
		}
	}}
}

type poolKey struct{}

// InTx runs fn in a transaction on the worker's database, fenced by the
// current run's lease, and commits it: a run that lost its lease (a pause,
// a network cut) never commits after another replica took the job over.
// ctx must be the context Job.Run received (or derived from it); fn must
// use ctx for its statements and must not commit or roll back tx itself.
// Inside tx, current_setting('worker.fencing_token') is the lease's
// fencing token, greater than that of any earlier run of the job.
//
// A COMMIT that got no answer returns an error wrapping ErrCommitUnknown.
func InTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	pool, _ := ctx.Value(poolKey{}).(*pgxpool.Pool)
	if pool == nil {
		return errNoJobRun
	}
	return ijobs.InTx(ctx, pool, fn)
}

// ErrCommitUnknown is wrapped by InTx's error when the COMMIT was sent but
// no answer came back: the writes may or may not be in.
var ErrCommitUnknown = ijobs.ErrCommitUnknown

// WithTaskKind adds a Go task kind: River runs w for tasks whose args are
// a T, enqueued with tasks.Enqueue. Its retries, dead letters, queue and
// concurrency follow the kind's entry in tasks.kinds, or the defaults.
func WithTaskKind[T river.JobArgs](w river.Worker[T]) Option {
	return Option{func(x *startup.Extensions) {
		prev := x.Tasks
		x.Tasks = func(r *itasks.Registry) error {
			if prev != nil {
				if err := prev(r); err != nil {
					return err
				}
			}
			return itasks.AddWorker(r, w)
		}
	}}
}

// WithOnReady adds a function that the worker starts, in a goroutine of
// its own, once `run` is ready: migrations applied, jobs, relay and tasks
// started. The operator commands (`config print`, `outbox stats`, ...)
// never start it, so a program can start its own servers or producers
// here instead of before Run. ctx is cancelled when shutdown begins
// (SIGTERM or SIGINT); the worker waits for f to return, within the
// shutdown budget, before Run returns.
func WithOnReady(f func(ctx context.Context)) Option {
	return Option{func(x *startup.Extensions) { x.OnReady = append(x.OnReady, f) }}
}

// WithInboxHandler adds a Go inbox handler, which inbox sources select with
// handler.kind: name. handle does one message's work in tx, the
// transaction that also records the message as processed, so the work is
// done once however often the message is delivered. It may write
// outgoing events in tx with outbox.Append. An error rolls the work back;
// the message is retried with backoff, then dead-lettered (at once for
// inbox.Permanent). name must not be sql or river. A handler that also acts
// outside the database (an HTTP call, an email) is declared so on its
// sources with effects: external: its claim then commits before its work,
// and a crash mid-work hands the message to an operator instead of running
// it again (docs/inbox.md, "Handler effects").
func WithInboxHandler(name string, handle func(ctx context.Context, tx pgx.Tx, m inbox.Message) error) Option {
	return Option{func(x *startup.Extensions) {
		if x.InboxHandlers == nil {
			x.InboxHandlers = map[string]iinbox.Handler{}
		}
		x.InboxHandlers[name] = iinbox.HandlerFunc(handle)
	}}
}

// WithSink adds an outbox sink, selected with outbox.sink=name
// (APP_OUTBOX_SINK). newSink is called once, when the relay starts; an
// error stops the worker. name must not be a built-in sink's (log,
// webhook, nats, rabbitmq, kafka, river).
func WithSink(name string, newSink func(ctx context.Context) (outbox.Sink, error)) Option {
	return Option{func(x *startup.Extensions) {
		if x.Sinks == nil {
			x.Sinks = map[string]func(context.Context) (ioutbox.Sink, error){}
		}
		x.Sinks[name] = func(ctx context.Context) (ioutbox.Sink, error) {
			s, err := newSink(ctx)
			if err != nil {
				return nil, err
			}
			return portSink{s}, nil
		}
	}}
}
