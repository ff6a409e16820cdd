package outbox

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/worker-dev/worker/internal/testkit"
	"github.com/worker-dev/worker/internal/tracing"
)

var (
	benchOTLP      sync.Once
	benchOTLPBytes atomic.Int64
	benchTP        *sdktrace.TracerProvider
	benchSampling  toggledSampler
)

type discardSink struct{}

func (discardSink) Name() string                         { return "log" }
func (discardSink) Publish(context.Context, Event) error { return nil }

// BenchmarkTracedPublish is the worker's own share of a traced publish,
// without the database: one span per event, batched and exported over
// OTLP/HTTP to a local receiver that discards it, as the relay
// benchmark's traced phases do. It runs at the worker's collector target
// and reports the process's CPU per event (cpu_ns/op), the exporter's
// goroutine included:
//
//   - sampled: the relay's traced publish, every span sampled;
//   - unsampled: the same with nothing sampled, the floor of tracing on;
//   - bare span: the SDK alone, a span with no attribute and no trace
//     context read or written, sampled and exported: the least a
//     per-event span can cost.
//
// Profile it with -cpuprofile to see where a span's cost goes. Run it
// alone (-run '^$'): a test that installed its own provider first would
// receive its spans instead.
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
		// The processor waits for the exporter instead of dropping a span
		// that finds its queue full, so every span is paid for.
		benchTP = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp, sdktrace.WithBlocking()), sdktrace.WithSampler(&benchSampling))
		tracing.Use(benchTP)
	})
	defer debug.SetGCPercent(debug.SetGCPercent(200)) // the worker's (defaultGCPercent in internal/startup)
	events := make([]Event, 1000)
	for i := range events {
		events[i] = Event{EventID: "0193a5b2-7c1e-7d3f-9a4b-" + strconv.Itoa(100000000000+i), EventType: "order.paid",
			AggregateType: "order", AggregateID: strconv.Itoa(i), Headers: map[string]string{
				"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "content-type": "application/json"}}
	}
	s := Traced(discardSink{})
	publish := func(b *testing.B, i int) {
		if err := s.Publish(context.Background(), events[i%len(events)]); err != nil {
			b.Fatal(err)
		}
	}
	bare := func(_ *testing.B, _ int) {
		_, span := tracer.Start(context.Background(), "publish")
		span.End()
	}
	for _, c := range []struct {
		name    string
		sampled bool
		op      func(*testing.B, int)
	}{
		{"sampled", true, publish},
		{"unsampled", false, publish},
		{"bare span", true, bare},
	} {
		b.Run(c.name, func(b *testing.B) {
			benchSampling.on.Store(c.sampled)
			from := benchOTLPBytes.Load()
			b.ReportAllocs()
			cpu0 := testkit.SelfCPU(b)
			b.ResetTimer()
			for i := range b.N {
				c.op(b, i)
			}
			if err := benchTP.ForceFlush(context.Background()); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64((testkit.SelfCPU(b)-cpu0).Nanoseconds())/float64(b.N), "cpu_ns/op")
			got := benchOTLPBytes.Load() - from
			if c.sampled && got == 0 {
				b.Fatal("no span reached the receiver: run the benchmark alone (-run '^$')")
			}
			b.ReportMetric(float64(got)/float64(b.N), "otlp_B/op")
		})
	}
}
