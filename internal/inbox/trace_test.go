package inbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/tracing"
)

// spanRecorder records the spans of every test in the process. The
// provider is installed once: the package's tracer follows the first
// global provider set, not a later one.
var spanRecorder = sync.OnceValue(func() *tracetest.SpanRecorder {
	rec := tracetest.NewSpanRecorder()
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	return rec
})

// A message carrying a sender's traceparent is processed in a CONSUMER
// span that continues the sender's trace; the Go handler's ctx carries that
// span, and the event it appends carries the span on in its traceparent.
func TestConsumerSpanContinuesTheSendersTrace(t *testing.T) {
	t.Parallel()
	rec := spanRecorder()
	db := workDB(t)
	ctx := context.Background()
	var inHandler trace.SpanContext
	h := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		inHandler = trace.SpanContextFromContext(ctx)
		_, err := outbox.Append(ctx, tx, outbox.NewEvent{AggregateType: "receipt", AggregateID: m.ID, EventType: "receipt.sent", Payload: m.Body})
		return err
	})
	c := newConsumer(t, db, "a", testConfig(), h)
	const sender, senderSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	d := &inbox.Delivery{
		Message: inbox.Message{Source: "orders", ID: "order-1", Body: []byte(`{}`), Origin: "orders.paid",
			Headers: map[string]string{"Traceparent": "00-" + sender + "-" + senderSpan + "-01"}}, // as an HTTP source keeps it
		Settle: func(context.Context, inbox.Outcome, time.Duration) error { return nil },
	}
	c.Process(ctx, []*inbox.Delivery{d})

	// The provider is global, so the recorder also sees the spans of the
	// tests running beside this one: this message's is the one with its id.
	var span sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		for _, a := range s.Attributes() {
			if s.Name() == "process test" && a.Key == "messaging.message.id" && a.Value.AsString() == "order-1" {
				span = s
			}
		}
	}
	if span == nil {
		t.Fatalf("no process span recorded")
	}
	if span.SpanKind() != trace.SpanKindConsumer || span.Parent().TraceID().String() != sender || span.Parent().SpanID().String() != senderSpan {
		t.Fatalf("process span kind %v, parent %s/%s; want CONSUMER under %s/%s", span.SpanKind(),
			span.Parent().TraceID(), span.Parent().SpanID(), sender, senderSpan)
	}
	if inHandler.SpanID() != span.SpanContext().SpanID() {
		t.Errorf("the handler's ctx carries span %s, want the process span %s", inHandler.SpanID(), span.SpanContext().SpanID())
	}
	var tp string
	if err := db.Pool.QueryRow(ctx, `SELECT headers->>'traceparent' FROM outbox_event WHERE aggregate_id = 'order-1'`).Scan(&tp); err != nil {
		t.Fatal(err)
	}
	if want := "00-" + sender + "-" + span.SpanContext().SpanID().String() + "-01"; tp != want {
		t.Errorf("the appended event's traceparent is %q, want the process span's %q", tp, want)
	}
}
