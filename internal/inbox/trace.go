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

// batchSpanKey carries a work transaction's span in ctx beside, not as,
// the active span: a message without a traceparent still starts a trace of
// its own rather than nesting under the transaction.
type batchSpanKey struct{}

// startBatch starts the span of a work transaction that runs n messages
// together. The messages may come from as many traces, so each message's
// process span is a link of it (linkBatch), as the messaging conventions
// have a batch's span link its messages; the span itself is a trace of its
// own. One message needs none: its process span says it all.
func (c *Consumer) startBatch(ctx context.Context, n int) (context.Context, trace.Span) {
	if n < 2 || !tracing.Enabled() {
		return ctx, nil
	}
	_, span := tracer.Start(ctx, "process "+c.name+" batch", trace.WithNewRoot(),
		trace.WithAttributes(
			attribute.String("messaging.system", c.kind),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.consumer.group.name", c.name),
			attribute.Int("messaging.batch.message_count", n),
		))
	return context.WithValue(ctx, batchSpanKey{}, span), span
}

// linkBatch links the work transaction's span in ctx, if any, to a
// message's process span.
func linkBatch(ctx context.Context, process trace.Span) {
	if b, ok := ctx.Value(batchSpanKey{}).(trace.Span); ok {
		b.AddLink(trace.Link{SpanContext: process.SpanContext()})
	}
}
