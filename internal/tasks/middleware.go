package tasks

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
	"github.com/worker-dev/worker/internal/tracing"
)

// observer wraps every task run (a River worker middleware). It gives the
// run its kind's timeout and a logger carrying the task's identity and
// propagated context, and it reports how the run ended: logs, task_* metrics,
// job_retry_total and job_dlq_total. River decides the task's next state from
// the same inputs (the error, the attempt, the context's cause), and
// classify mirrors its rules.
type observer struct {
	river.MiddlewareDefaults
	cfg *tasksconfig.Config
	log *slog.Logger
	m   *metrics
}

func (o *observer) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) (err error) {
	meta := metaFromJob(job.Metadata)
	ctx, span := startRun(ctx, job, &meta)
	defer func() { tracing.End(span, err) }()
	log := o.log.With("task_id", job.ID, "task_kind", job.Kind, "queue", job.Queue, "attempt", job.Attempt,
		"max_attempts", job.MaxAttempts).With(meta.logAttrs()...)
	if span.IsRecording() {
		log = log.With("span_id", span.SpanContext().SpanID().String())
	}
	ctx = obs.WithLogger(WithMeta(ctx, meta), log)
	if job.AttemptedAt != nil {
		o.m.wait.WithLabelValues(job.Queue).Observe(max(job.AttemptedAt.Sub(job.ScheduledAt), 0).Seconds())
	}
	timeout := o.cfg.Timeout
	if k, ok := o.cfg.KindNamed(job.Kind); ok {
		timeout = k.Timeout
	}
	runCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	start := time.Now()
	log.Debug("task run started")
	defer func() {
		p := recover()
		if p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
		o.report(ctx, runCtx, log, job, err, timeout, time.Since(start))
		if p != nil {
			panic(p) // River records the panic and its stack trace
		}
	}()
	return doInner(runCtx)
}

// classify names how a run ended. ctx is the run's context from River
// (cancelled at shutdown or by an operator), runCtx the one with the kind's
// timeout.
func classify(ctx, runCtx context.Context, err error) string {
	var (
		snooze *rivertype.JobSnoozeError
		cancel *rivertype.JobCancelError
	)
	switch {
	case err == nil:
		return OutcomeSuccess
	case errors.As(err, &snooze):
		return OutcomeSnoozed
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), river.ErrJobCancelledRemotely):
		return OutcomeCancelled
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		// River's client stopping (StopAndCancel): it makes the task
		// available again without using up the attempt.
		return OutcomeInterrupted
	case errors.As(err, &cancel):
		return OutcomePermanent
	case errors.Is(runCtx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return OutcomeTimeout
	}
	return OutcomeFailure
}

func (o *observer) report(ctx, runCtx context.Context, log *slog.Logger, job *rivertype.JobRow, err error, timeout, took time.Duration) {
	outcome := classify(ctx, runCtx, err)
	o.m.runs.WithLabelValues(job.Kind, outcome).Inc()
	obs.ObserveCtx(ctx, o.m.duration.WithLabelValues(job.Kind), took.Seconds())
	log = log.With("outcome", outcome, "duration_ms", took.Milliseconds())
	switch outcome {
	case OutcomeSuccess:
		log.Info("task run succeeded")
	case OutcomeSnoozed:
		var down *endpointDownError
		if errors.As(err, &down) {
			// The breaker logs the outage once; a line per task would flood.
			log.Debug("task waits for its endpoint", "error", err)
			return
		}
		log.Info("task snoozed", "error", err)
	case OutcomeCancelled:
		log.Warn("task cancelled by an operator while it ran")
	case OutcomeInterrupted:
		log.Warn("task run interrupted by shutdown; it runs again later without using an attempt")
	case OutcomePermanent:
		o.deadLetter(log, job, err, rivertype.JobStateCancelled)
	default:
		if outcome == OutcomeTimeout {
			log.Warn("task run timed out and was cancelled", "error.code", obs.CodeJobTimeout, "timeout", timeout.String(), "error", err)
		}
		if job.Attempt >= job.MaxAttempts {
			o.deadLetter(log, job, err, rivertype.JobStateDiscarded)
			return
		}
		o.m.shared.Retry.WithLabelValues(job.Kind, obs.RetryScheduled).Inc()
		log.Warn("task run failed; retry scheduled", "error", err)
	}
}

func (o *observer) deadLetter(log *slog.Logger, job *rivertype.JobRow, err error, state rivertype.JobState) {
	o.m.shared.DLQ.WithLabelValues(job.Kind).Inc()
	log.Error("task dead-lettered", "error.code", obs.CodeJobDeadLetter, "state", string(state), "error", err)
}
