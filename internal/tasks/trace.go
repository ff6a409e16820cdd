package tasks

import (
	"context"
	"strconv"

	"github.com/riverqueue/river/rivertype"
	"github.com/riverqueue/rivercontrib/otelriver"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/tracing"
)

var tracer = otel.Tracer("github.com/worker-dev/worker/internal/tasks")

// insertTracing is otelriver's middleware for the insert-only client: an
// enqueue gets a river.insert_many PRODUCER span under the caller's span
// (an inbox handler's, a job's, a task's), and the task's metadata the
// traceparent of that span. It uses the global provider, a no-op while
// tracing is off.
func insertTracing() rivertype.Middleware {
	return otelriver.NewMiddleware(&otelriver.MiddlewareConfig{EnableTracePropagation: true})
}

// startRun starts a task run's CONSUMER span, a child of the context its
// metadata carries (the enqueue's span), so the run stays in the trace
// that enqueued it, and makes meta's trace_id the span's.
func startRun(ctx context.Context, job *rivertype.JobRow, meta *Meta) (context.Context, trace.Span) {
	ctx, span := tracer.Start(tracing.Extract(ctx, map[string]string{tracing.Traceparent: meta.Traceparent}),
		"process "+job.Kind, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("messaging.system", "river"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.operation.name", "process"),
			attribute.String("messaging.destination.name", job.Queue),
			attribute.String("messaging.message.id", strconv.FormatInt(job.ID, 10)),
			attribute.String("worker.task.kind", job.Kind),
			attribute.Int("worker.task.attempt", job.Attempt),
		)
		meta.TraceID = span.SpanContext().TraceID().String()
	}
	return ctx, span
}

// traced is m with the traceparent of ctx's span, when there is one: a
// task enqueued in a traced context continues that trace (otelriver then
// puts its insert span's context in that place).
func (m Meta) traced(ctx context.Context) Meta {
	if tp := tracing.Inject(ctx, nil)[tracing.Traceparent]; tp != "" {
		m.Traceparent, m.TraceID = tp, ""
	}
	return m
}
