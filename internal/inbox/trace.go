package inbox

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/tracing"
)

var tracer = otel.Tracer("github.com/worker-dev/worker/internal/inbox")

// startProcess starts m's CONSUMER span (the messaging conventions'
// "process"), continuing the sender's trace from m's traceparent header,
// or a new root when it has none. The handler runs in the returned ctx, so
// its own spans, its tasks and its outbox.Append nest under it.
func (c *Consumer) startProcess(ctx context.Context, m Message) (context.Context, trace.Span) {
	ctx, span := tracer.Start(tracing.Extract(ctx, m.Headers), "process "+c.name,
		trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("messaging.system", c.kind),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.operation.name", "process"),
			attribute.String("messaging.destination.name", m.Origin),
			attribute.String("messaging.consumer.group.name", c.name),
			attribute.String("messaging.message.id", m.ID),
			attribute.String("cloudevents.event_source", m.Source),
			attribute.String("cloudevents.event_type", m.Type),
			attribute.Int("worker.inbox.attempt", m.Attempt),
		)
	}
	return ctx, span
}
