package outbox

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/tracing"
)

type headerSink struct{ got []Event }

func (s *headerSink) Name() string { return "fake" }

func (s *headerSink) Publish(_ context.Context, e Event) error {
	s.got = append(s.got, e)
	return nil
}

type headerTxSink struct {
	headerSink
	failed []error
}

func (s *headerTxSink) PublishTx(_ context.Context, _ pgx.Tx, events []Event) ([]error, error) {
	s.got = append(s.got, events...)
	return s.failed, nil
}

// A traced sink publishes each event in a PRODUCER span whose parent is
// the event's traceparent (a new root without one), and hands the sink
// the event with the publish span's context in its headers; the claimed
// event's own headers stay as they were. A TxSink stays a TxSink, with one
// span per event, failed where its event failed. An unsampled event
// records nothing, and its context still travels, marked unsampled.
func TestTracedSinkPublishSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	var sampling toggledSampler
	sampling.on.Store(true)
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(&sampling)))
	const producer = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	withParent := Event{EventID: "e1", EventType: "order.paid", AggregateID: "o-1", Attempts: 2,
		Headers: map[string]string{"traceparent": producer, "k": "v"}}
	orphan := Event{EventID: "e2", EventType: "order.paid"}

	plain := &headerSink{}
	s := Traced(plain)
	for _, e := range []Event{withParent, orphan} {
		if err := s.Publish(context.Background(), e); err != nil {
			t.Fatal(err)
		}
	}
	if withParent.Headers["traceparent"] != producer {
		t.Fatalf("the claimed event's headers changed: %v", withParent.Headers)
	}
	spans := rec.Ended()
	if len(spans) != 2 || len(plain.got) != 2 {
		t.Fatalf("%d spans, %d published; want 2 and 2", len(spans), len(plain.got))
	}
	first, second := spans[0], spans[1]
	if first.SpanKind() != trace.SpanKindProducer || first.Name() != "publish order.paid" ||
		first.Parent().SpanID().String() != "00f067aa0ba902b7" || first.SpanContext().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("publish span %s (%v), parent %s; want PRODUCER under the producer's span", first.Name(), first.SpanKind(), first.Parent().SpanID())
	}
	attrs := map[string]string{}
	for _, kv := range first.Attributes() {
		attrs[string(kv.Key)] = kv.Value.Emit()
	}
	for k, v := range map[string]string{"messaging.system": "fake", "messaging.operation.type": "send",
		"messaging.message.id": "e1", "worker.outbox.aggregate_id": "o-1", "worker.outbox.attempt": "3"} {
		if attrs[k] != v {
			t.Errorf("publish span attribute %s = %q, want %q (all: %v)", k, attrs[k], v, attrs)
		}
	}
	if want := "00-4bf92f3577b34da6a3ce929d0e0e4736-" + first.SpanContext().SpanID().String() + "-01"; plain.got[0].Headers["traceparent"] != want || plain.got[0].Headers["k"] != "v" {
		t.Errorf("the sink got headers %v, want traceparent %s and k=v", plain.got[0].Headers, want)
	}
	if second.Parent().IsValid() || plain.got[1].Headers["traceparent"] == "" {
		t.Errorf("an event without traceparent: parent %v, sent headers %v; want a new root, carried", second.Parent(), plain.got[1].Headers)
	}

	tx := &headerTxSink{failed: []error{nil, errors.New("refused")}}
	ts, ok := Traced(tx).(TxSink)
	if !ok {
		t.Fatal("Traced(TxSink) is no TxSink")
	}
	if _, err := ts.PublishTx(context.Background(), nil, []Event{withParent, orphan}); err != nil {
		t.Fatal(err)
	}
	spans = rec.Ended()[2:]
	if len(spans) != 2 || spans[0].Status().Code == codes.Error || spans[1].Status().Code != codes.Error {
		t.Fatalf("TxSink spans: %d, statuses %v / %v; want ok then error", len(spans), spans[0].Status(), spans[1].Status())
	}
	if tx.got[0].Headers["traceparent"] != "00-4bf92f3577b34da6a3ce929d0e0e4736-"+spans[0].SpanContext().SpanID().String()+"-01" {
		t.Errorf("TxSink got %v", tx.got[0].Headers)
	}

	sampling.on.Store(false)
	if err := s.Publish(context.Background(), withParent); err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Ended()); n != 4 {
		t.Errorf("an unsampled publish recorded a span: %d spans, want 4", n)
	}
	sent := plain.got[len(plain.got)-1].Headers["traceparent"]
	if !strings.HasPrefix(sent, "00-4bf92f3577b34da6a3ce929d0e0e4736-") || !strings.HasSuffix(sent, "-00") || sent == producer {
		t.Errorf("an unsampled publish sent traceparent %q, want the producer's trace, a new span id, unsampled", sent)
	}
}

// toggledSampler samples every span or none, as a test or benchmark asks:
// OpenTelemetry's global provider delegates to the first one set, so a
// second provider with another sampler would not be used.
type toggledSampler struct{ on atomic.Bool }

func (s *toggledSampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	if s.on.Load() {
		return sdktrace.AlwaysSample().ShouldSample(p)
	}
	return sdktrace.NeverSample().ShouldSample(p)
}

func (s *toggledSampler) Description() string { return "toggled" }
