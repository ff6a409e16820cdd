// Package tracing sets up OpenTelemetry tracing from the standard OTEL_*
// variables, and holds the helpers the relay, the inbox, jobs and tasks
// share to carry a W3C trace context in an event's or message's headers.
//
// Tracing is off unless the variables turn it on. Off, no exporter is
// built and the global tracer provider stays OpenTelemetry's no-op one, so
// every span the worker starts is a no-op: no allocation of a recording
// span, no export, no connection.
//
// Only startup calls Setup. The instrumented packages use the global
// provider (otel.Tracer), so a program that embeds the worker and sets its
// own provider gets the worker's spans in it.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/obs"
)

// The variables this package decides on itself; the SDK and the OTLP
// exporters read the rest (endpoint, headers, timeout, TLS, sampler
// argument, resource attributes) from the process environment as the
// OpenTelemetry specification says.
const (
	envDisabled       = "OTEL_SDK_DISABLED"
	envExporter       = "OTEL_TRACES_EXPORTER"
	envProtocol       = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envSampler        = "OTEL_TRACES_SAMPLER"

	protoHTTP = "http/protobuf"
	protoGRPC = "grpc"

	// DefaultServiceName is service.name unless OTEL_SERVICE_NAME or
	// OTEL_RESOURCE_ATTRIBUTES says otherwise.
	DefaultServiceName = "worker"
	// shutdownBudget bounds the final flush at exit: an unreachable
	// collector must not hold the exit past the shutdown budget.
	shutdownBudget = 5 * time.Second
)

// samplers are the OTEL_TRACES_SAMPLER values the SDK knows.
var samplers = []string{"always_on", "always_off", "traceidratio", "parentbased_always_on",
	"parentbased_always_off", "parentbased_traceidratio"}

// Settings is what the variables put in force.
type Settings struct {
	On       bool
	Why      string // why it is off, or the exporter when on
	Protocol string // http/protobuf or grpc
	Endpoint string // as given; "" means the exporter's default
	Sampler  string // as given; "" means parentbased_always_on
}

// Error is a bad OTEL_* value: the worker refuses to start on it, as on
// any invalid setting, instead of running untraced by surprise.
type Error struct{ Msg string }

func (e *Error) Error() string { return e.Msg }

// Read decides from the variables whether tracing is on. It is on when
// OTEL_TRACES_EXPORTER is otlp, or unset while an OTLP endpoint is given;
// OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none turn it off.
func Read(getenv func(string) string) (Settings, error) {
	s := Settings{
		Protocol: strings.ToLower(first(getenv(envTracesProtocol), getenv(envProtocol), protoHTTP)),
		Endpoint: first(getenv(envTracesEndpoint), getenv(envEndpoint)),
		Sampler:  strings.ToLower(strings.TrimSpace(getenv(envSampler))),
	}
	if s.Protocol != protoHTTP && s.Protocol != protoGRPC {
		return s, &Error{fmt.Sprintf("%s=%q: want %s or %s", envProtocol, s.Protocol, protoHTTP, protoGRPC)}
	}
	if s.Sampler != "" && !slices.Contains(samplers, s.Sampler) {
		return s, &Error{fmt.Sprintf("%s=%q: want one of %s", envSampler, s.Sampler, strings.Join(samplers, ", "))}
	}
	exp := strings.ToLower(strings.TrimSpace(getenv(envExporter)))
	switch {
	case strings.EqualFold(strings.TrimSpace(getenv(envDisabled)), "true"):
		s.Why = envDisabled + "=true"
	case exp == "none":
		s.Why = envExporter + "=none"
	case exp == "otlp", exp == "" && s.Endpoint != "":
		s.On, s.Why = true, "otlp"
	case exp == "":
		s.Why = "no " + envExporter + " nor OTLP endpoint set"
	default:
		return s, &Error{fmt.Sprintf("%s=%q: want otlp or none", envExporter, exp)}
	}
	return s, nil
}

// Describe is one line saying what is in force, for config print and the
// startup line. The endpoint's credentials are masked, as everywhere.
func (s Settings) Describe() string {
	if !s.On {
		return "off (" + s.Why + ")"
	}
	return fmt.Sprintf("on: exporter=otlp protocol=%s endpoint=%s sampler=%s", s.Protocol,
		s.endpoint(), first(s.Sampler, "parentbased_always_on"))
}

// endpoint is where the spans go, for a log line: credentials masked.
func (s Settings) endpoint() string {
	return obs.MaskDSN(first(s.Endpoint, "<exporter default>"))
}

// Setup builds the tracer provider s asks for and installs it as the
// global one, with the W3C trace-context propagator. The returned shutdown
// flushes what is buffered and stops the exporter; it is a no-op when
// tracing is off. version and instanceID become service.version and
// service.instance.id. The exporter's outages and the SDK's errors go to
// log.
func Setup(ctx context.Context, s Settings, version, instanceID string, log *slog.Logger) (shutdown func(), err error) {
	if !s.On {
		return func() {}, nil
	}
	var exp sdktrace.SpanExporter
	if s.Protocol == protoGRPC {
		exp, err = otlptracegrpc.New(ctx)
	} else {
		exp, err = otlptracehttp.New(ctx)
	}
	if err != nil {
		return nil, &Error{fmt.Sprintf("OTLP trace exporter: %v", err)}
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", DefaultServiceName),
			attribute.String("service.version", version), attribute.String("service.instance.id", instanceID)),
		resource.WithFromEnv(), resource.WithTelemetrySDK())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, &Error{fmt.Sprintf("OTEL_RESOURCE_ATTRIBUTES: %v", err)}
	}
	exp = &watchedExporter{SpanExporter: exp, log: log, endpoint: s.endpoint()}
	// The sampler comes from OTEL_TRACES_SAMPLER(_ARG), read by the SDK.
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	handleErrors(log)
	Use(tp)
	return func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownBudget)
		defer cancel()
		_ = tp.Shutdown(sctx)
	}, nil
}

// enabled is set once Use installed a provider.
var enabled atomic.Bool

// Use makes tp the provider of the worker's spans (the global one) and
// turns tracing on: Setup calls it, and so may a test or an embedding
// program with a provider of its own.
func Use(tp trace.TracerProvider) {
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	enabled.Store(true)
}

// Enabled reports whether tracing is on. Off, nothing reads or writes a
// trace context (Extract), so the worker behaves exactly as without
// tracing; the relay asks once, when it is built, and keeps its per-event
// path as it is.
func Enabled() bool { return enabled.Load() }

func first(vs ...string) string {
	for _, v := range vs {
		if v = strings.TrimSpace(v); v != "" {
			return v
		}
	}
	return ""
}
