package obs

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/trace"
)

// NewRegistry returns the private registry /metrics serves, with the Go and
// process collectors. A private registry keeps library globals out and lets
// tests build as many as they like.
func NewRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

// ObserveCtx observes v, with the trace id of ctx's span as the
// observation's exemplar when the span is sampled, so a latency panel can
// link to the trace of a slow run (exemplars are served to scrapers that
// ask for OpenMetrics).
func ObserveCtx(ctx context.Context, o prometheus.Observer, v float64) {
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		if eo, ok := o.(prometheus.ExemplarObserver); ok {
			eo.ObserveWithExemplar(v, prometheus.Labels{"trace_id": sc.TraceID().String()})
			return
		}
	}
	o.Observe(v)
}
