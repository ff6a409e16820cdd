package outbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/tracing"
)

// tracer is resolved through the global provider at each span, so it
// follows tracing.Setup whenever that runs.
var tracer = otel.Tracer("github.com/worker-dev/worker/internal/outbox")

// Traced returns s with a PRODUCER span around each publish (the
// OpenTelemetry messaging conventions' "send"): its parent is the context
// in the event's traceparent header, when it has one, and it is a new
// root otherwise. The sink gets the event with traceparent and tracestate
// replaced by the publish span's, so every binding carries the span on to
// the consumer. A TxSink stays a TxSink. While tracing is off (tracing.
// Enabled), Traced returns s itself: the relay pays nothing.
func Traced(s Sink) Sink {
	if !tracing.Enabled() {
		return s
	}
	t := tracedSink{s}
	if ts, ok := s.(TxSink); ok {
		return tracedTxSink{t, ts}
	}
	return t
}

type tracedSink struct{ Sink }

func (t tracedSink) Publish(ctx context.Context, e Event) error {
	ctx, span := startPublish(ctx, t.Name(), &e)
	err := t.Sink.Publish(ctx, e)
	tracing.End(span, err)
	return err
}

type tracedTxSink struct {
	tracedSink
	tx TxSink
}

func (t tracedTxSink) PublishTx(ctx context.Context, tx pgx.Tx, events []Event) (failed []error, err error) {
	spans := make([]trace.Span, len(events))
	traced := make([]Event, len(events))
	for i, e := range events {
		_, spans[i] = startPublish(ctx, t.Name(), &e)
		traced[i] = e
	}
	failed, err = t.tx.PublishTx(ctx, tx, traced)
	for i, span := range spans {
		ferr := err
		if ferr == nil && i < len(failed) {
			ferr = failed[i]
		}
		tracing.End(span, ferr)
	}
	return failed, err
}

// startPublish starts e's publish span and puts its context in e's
// headers (a copy: the claimed row's map is reused by a retry). The
// attributes are built only for a span that records: an unsampled span
// would drop them, and building them was half of its cost.
func startPublish(ctx context.Context, sink string, e *Event) (context.Context, trace.Span) {
	ctx, span := tracer.Start(tracing.Extract(ctx, e.Headers), "publish "+e.EventType,
		trace.WithSpanKind(trace.SpanKindProducer))
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("messaging.system", sink),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.operation.name", "publish"),
			attribute.String("messaging.message.id", e.EventID),
			attribute.String("cloudevents.event_type", e.EventType),
			attribute.String("worker.outbox.aggregate_type", e.AggregateType),
			attribute.String("worker.outbox.aggregate_id", e.AggregateID),
			attribute.Int("worker.outbox.attempt", e.Attempts+1),
		)
	}
	e.Headers = tracing.Inject(ctx, e.Headers)
	return ctx, span
}
