package jobs

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/tracing"
)

var tracer = otel.Tracer("github.com/worker-dev/worker/internal/jobs")

// startRun starts the span of one run of job name: a root, since a run
// is started by the clock, not by a caller.
func startRun(ctx context.Context, name, runID string, token int64) (context.Context, trace.Span) {
	return tracer.Start(ctx, "job "+name, trace.WithNewRoot(), trace.WithAttributes(
		attribute.String("worker.job.name", name),
		attribute.String("worker.job.run_id", runID),
		attribute.Int64("worker.job.fencing_token", token),
	))
}

// endRun records the run's outcome and ends its span, failed unless the
// outcome is success. A lost lease is an error event, also on a run that
// still counts as a success because its fenced transaction committed
// first.
func endRun(ctx context.Context, span trace.Span, outcome, code string, err error) {
	span.SetAttributes(attribute.String("worker.job.outcome", outcome))
	if code != "" {
		span.SetAttributes(attribute.String("error.code", code))
	}
	if errors.Is(context.Cause(ctx), lock.ErrLeaseLost) || errors.Is(err, lock.ErrLeaseLost) {
		span.AddEvent("lease lost", trace.WithAttributes(attribute.String("exception.message", lock.ErrLeaseLost.Error())))
	}
	if err == nil && outcome != OutcomeSuccess {
		err = errors.New(outcome) // a timeout or a cancellation without an error of its own
	}
	tracing.End(span, err)
}
