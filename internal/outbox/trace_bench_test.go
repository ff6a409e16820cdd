package outbox

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/worker-dev/worker/internal/tracing"
)

var (
	benchOTLP      sync.Once
	benchOTLPBytes atomic.Int64
	benchTP        *sdktrace.TracerProvider
)

type discardSink struct{}

func (discardSink) Name() string                         { return "log" }
func (discardSink) Publish(context.Context, Event) error { return nil }

// BenchmarkTracedPublish is the worker's own share of a traced publish:
// one span per event, sampled, batched and exported over OTLP/HTTP to a
// local receiver that discards it, as the relay benchmark's traced phases
// do, without the database. Profile it with -cpuprofile to see where a
// span's cost goes. Run it alone (-run '^$'): a test that installed its
// own provider first would receive its spans instead.
func BenchmarkTracedPublish(b *testing.B) {
	benchOTLP.Do(func() {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n, _ := io.Copy(io.Discard, r.Body)
			benchOTLPBytes.Add(n)
			w.Header().Set("Content-Type", "application/x-protobuf")
		}))
		exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(srv.URL))
		if err != nil {
			b.Fatal(err)
		}
		// Installed once: OpenTelemetry's global provider delegates to the
		// first one set, and the benchmark function runs more than once.
		benchTP = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
		tracing.Use(benchTP)
	})
	from := benchOTLPBytes.Load()
	s := Traced(discardSink{})
	events := make([]Event, 1000)
	for i := range events {
		events[i] = Event{EventID: "0193a5b2-7c1e-7d3f-9a4b-" + strconv.Itoa(100000000000+i), EventType: "order.paid",
			AggregateType: "order", AggregateID: strconv.Itoa(i), Headers: map[string]string{
				"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "content-type": "application/json"}}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if err := s.Publish(context.Background(), events[i%len(events)]); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	_ = benchTP.ForceFlush(context.Background())
	got := benchOTLPBytes.Load() - from
	if got == 0 {
		b.Fatal("no span reached the receiver: run the benchmark alone (-run '^$')")
	}
	b.ReportMetric(float64(got)/float64(b.N), "otlp_B/op")
}
