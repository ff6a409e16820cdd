package tracing

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"golang.org/x/time/rate"

	"github.com/worker-dev/worker/internal/obs"
)

// watchedExporter is the OTLP exporter, with its outages logged as the
// worker logs every other dependency's: one WARN line when exports start
// failing, with error.code=TRACE_EXPORT_FAILED, and one INFO line when one
// succeeds again, saying how long it lasted and how many spans were lost.
// Without it the SDK prints every failed export on stderr, unstructured:
// one line per batch for as long as the collector is down.
type watchedExporter struct {
	sdktrace.SpanExporter
	log      *slog.Logger
	endpoint string

	mu    sync.Mutex
	since time.Time // the current outage's first failure; zero while exports succeed
	lost  int       // spans of the exports that failed since then
}

func (w *watchedExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	err := w.SpanExporter.ExportSpans(ctx, spans)
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case err != nil && w.since.IsZero():
		w.since, w.lost = time.Now(), len(spans)
		w.log.Warn("trace export failing; spans are dropped until the collector takes them again",
			"endpoint", w.endpoint, "spans", len(spans), "error", err, "error.code", obs.CodeTraceExportFailed)
	case err != nil:
		w.lost += len(spans)
	case !w.since.IsZero():
		w.log.Info("trace export works again", "endpoint", w.endpoint,
			"outage_ms", time.Since(w.since).Milliseconds(), "spans_lost", w.lost)
		w.since, w.lost = time.Time{}, 0
	}
	if err != nil {
		return logged{err}
	}
	return nil
}

// logged is an export error already logged: the error handler, to which
// the SDK hands it as well, passes over it.
type logged struct{ error }

func (l logged) Unwrap() error { return l.error }

// handleErrors sends the SDK's other errors (a span processor's, a
// provider's) to the worker's log instead of stderr, at most one a minute:
// they repeat as long as their cause lasts.
func handleErrors(log *slog.Logger) {
	every := &rate.Sometimes{Interval: time.Minute}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		if errors.As(err, new(logged)) {
			return
		}
		every.Do(func() { log.Warn("tracing failed; such failures are logged at most once a minute", "error", err) })
	}))
}
