package tracing

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/trace"
)

// Inject replaces traceparent and tracestate whatever their casing,
// leaves the caller's map alone, and adds nothing without a span; Extract
// reads them whatever their casing.
func TestInjectExtract(t *testing.T) {
	enabled.Store(true) // Extract reads nothing while tracing is off
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ts, _ := trace.ParseTraceState("shop=1")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts}))

	in := map[string]string{"Traceparent": "00-11111111111111111111111111111111-2222222222222222-01", "TraceState": "old=1", "k": "v"}
	out := Inject(ctx, in)
	want := map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "shop=1", "k": "v"}
	if len(out) != len(want) {
		t.Fatalf("Inject gave %v, want %v", out, want)
	}
	for k, v := range want {
		if out[k] != v {
			t.Errorf("Inject: %s=%q, want %q (all: %v)", k, out[k], v, out)
		}
	}
	if in["Traceparent"] != "00-11111111111111111111111111111111-2222222222222222-01" || len(in) != 3 {
		t.Errorf("Inject changed its argument: %v", in)
	}
	if got := Inject(context.Background(), in); len(got) != 3 || got["Traceparent"] != in["Traceparent"] {
		t.Errorf("Inject without a span changed the headers: %v", got)
	}

	sc := trace.SpanContextFromContext(Extract(context.Background(), map[string]string{
		"Traceparent": want["traceparent"], "Tracestate": "shop=1"}))
	if !sc.IsRemote() || sc.TraceID() != tid || sc.SpanID() != sid || sc.TraceState().String() != "shop=1" {
		t.Errorf("Extract gave %v", sc)
	}
}

// Read: off unless asked; an endpoint alone turns it on; disabled and
// none win; unknown values are errors.
func TestRead(t *testing.T) {
	for _, c := range []struct {
		env    map[string]string
		on     bool
		failed bool
	}{
		{nil, false, false},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, true, false},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, true, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, false, false},
		{map[string]string{"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, false, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "jaeger"}, false, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, false, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "often"}, false, true},
	} {
		s, err := Read(func(k string) string { return c.env[k] })
		if (err != nil) != c.failed || (err == nil && s.On != c.on) {
			t.Errorf("%v: on %v, error %v; want on %v, failing %v", c.env, s.On, err, c.on, c.failed)
		}
	}
}

// Describe masks an endpoint's credentials, as the logs do.
func TestDescribeMasksTheEndpoint(t *testing.T) {
	s, err := Read(func(k string) string {
		return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://user:secret@collector:4318"}[k]
	})
	if err != nil {
		t.Fatal(err)
	}
	if d := s.Describe(); d != "on: exporter=otlp protocol=http/protobuf endpoint=https://xxxxx@collector:4318 sampler=parentbased_always_on" {
		t.Errorf("Describe: %s", d)
	}
}
