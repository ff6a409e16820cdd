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

var (
	spansOnce sync.Once
	spans     *tracetest.SpanRecorder
)

// recordSpans turns tracing on, once for the package: OpenTelemetry's
// global provider delegates to the first one set, so the tests share its
// recorder and pick their own spans out by trace.
func recordSpans() *tracetest.SpanRecorder {
	spansOnce.Do(func() {
		spans = tracetest.NewSpanRecorder()
		tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)))
	})
	return spans
}

// A message carrying a sender's traceparent is processed in a CONSUMER
// span that continues the sender's trace; the Go handler's ctx carries that
// span, and the event it appends carries the span on in its traceparent.
func TestConsumerSpanContinuesTheSendersTrace(t *testing.T) {
	t.Parallel()
	rec := recordSpans()
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

	// The recorder also sees the spans of the tests running beside this
	// one: this message's is the one in the sender's trace.
	var span sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "process test" && s.Parent().TraceID().String() == sender {
			span = s
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

// Two messages from two traces worked in one transaction: each has its
// process span in its sender's trace, and the transaction has a span of
// its own that links both.
func TestBatchSpanLinksEachMessage(t *testing.T) {
	t.Parallel()
	rec := recordSpans()
	db := workDB(t)
	c := newConsumer(t, db, "a", testConfig(), inbox.HandlerFunc(func(context.Context, pgx.Tx, inbox.Message) error { return nil }))
	senders := map[string]string{"5bf92f3577b34da6a3ce929d0e0e4736": "order-7", "6bf92f3577b34da6a3ce929d0e0e4736": "order-8"}
	var batch []*inbox.Delivery
	for sender, id := range senders {
		batch = append(batch, &inbox.Delivery{
			Message: inbox.Message{Source: "orders", ID: id, Body: []byte(`{}`), Origin: "orders.paid",
				Headers: map[string]string{"traceparent": "00-" + sender + "-00f067aa0ba902b7-01"}},
			Settle: func(context.Context, inbox.Outcome, time.Duration) error { return nil },
		})
	}
	c.Process(context.Background(), batch)

	process := map[trace.SpanID]bool{} // the two messages' process spans
	var batchSpans []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if _, ok := senders[s.Parent().TraceID().String()]; ok && s.Name() == "process test" {
			process[s.SpanContext().SpanID()] = true
		}
		if s.Name() == "process test batch" {
			for _, l := range s.Links() {
				if _, ok := senders[l.SpanContext.TraceID().String()]; ok {
					batchSpans = append(batchSpans, s)
					break
				}
			}
		}
	}
	if len(process) != 2 || len(batchSpans) != 1 {
		t.Fatalf("%d process spans in the senders' traces, %d batch spans linking them; want 2 and 1", len(process), len(batchSpans))
	}
	b := batchSpans[0]
	if len(b.Links()) != 2 || b.Parent().IsValid() {
		t.Fatalf("the batch span has %d links and parent %v; want 2 and none", len(b.Links()), b.Parent())
	}
	for _, l := range b.Links() {
		if !process[l.SpanContext.SpanID()] {
			t.Errorf("the batch span links %v, not a message's process span", l.SpanContext)
		}
	}
	for _, a := range b.Attributes() {
		if a.Key == "messaging.batch.message_count" && a.Value.AsInt64() != 2 {
			t.Errorf("messaging.batch.message_count = %d, want 2", a.Value.AsInt64())
		}
	}
}
