package tracing

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/obs"
)

// The W3C trace-context headers, as the CloudEvents distributed-tracing
// extension names them in every binding (HTTP headers, AMQP application
// properties, Kafka headers, NATS headers) and as producers put them in
// outbox_event.headers.
const (
	Traceparent = "traceparent"
	Tracestate  = "tracestate"
)

// w3c reads and writes the two headers. It is used directly rather than
// through the global propagator, so an embedding program's propagator
// choice cannot change what the worker puts on the wire.
var w3c propagation.TraceContext

// Extract returns ctx with the remote span context that headers carry, if
// they carry a valid one and tracing is on. Names are matched without
// regard to case: an HTTP source keeps them canonical (Traceparent).
func Extract(ctx context.Context, headers map[string]string) context.Context {
	if len(headers) == 0 || !Enabled() {
		return ctx
	}
	return w3c.Extract(ctx, foldCarrier(headers))
}

// foldCarrier reads a header by its exact name, else by any casing of it.
type foldCarrier map[string]string

func (c foldCarrier) Get(key string) string {
	if v, ok := c[key]; ok {
		return v
	}
	for k, v := range c {
		if strings.EqualFold(k, key) {
			return v
		}
	}
	return ""
}

func (c foldCarrier) Set(key, value string) { c[key] = value }

func (c foldCarrier) Keys() []string { return slices.Collect(maps.Keys(c)) }

// Inject returns headers with traceparent and tracestate set to the span
// context in ctx. headers itself is left as it is (it may be shared, or
// reused by a retry); without a valid span context in ctx it is returned
// unchanged.
func Inject(ctx context.Context, headers map[string]string) map[string]string {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return headers
	}
	out := make(map[string]string, len(headers)+2)
	for k, v := range headers {
		// Replaced whatever their casing: the new context's, or none.
		if !strings.EqualFold(k, Traceparent) && !strings.EqualFold(k, Tracestate) {
			out[k] = v
		}
	}
	w3c.Inject(ctx, propagation.MapCarrier(out))
	return out
}

// End ends span. A non-nil err marks it failed, with an exception event
// whose message has its credentials masked as in the logs (obs.MaskDSN):
// a broker's or a database's error may quote a URL.
func End(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		msg := obs.MaskDSN(err.Error())
		span.AddEvent("exception", trace.WithAttributes(
			attribute.String("exception.type", fmt.Sprintf("%T", err)), attribute.String("exception.message", msg)))
		span.SetStatus(codes.Error, msg)
	}
	span.End()
}
