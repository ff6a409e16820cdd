package startup

import (
	"context"
	"log/slog"
	"strings"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/tracing"
)

// TracingSettings reads the OTEL_* variables from a command's environment.
// A bad value is a configuration error, as for APP_*.
func TracingSettings(environ []string) (tracing.Settings, error) {
	s, err := tracing.Read(func(k string) string {
		for _, kv := range environ {
			if v, ok := strings.CutPrefix(kv, k+"="); ok {
				return v
			}
		}
		return ""
	})
	if err != nil {
		return s, config.Errorf("%w", err)
	}
	return s, nil
}

// startTracing turns tracing on when the OTEL_* variables ask for it. The
// returned stop flushes the spans still buffered; run defers it first, so
// it runs after every component has stopped.
func startTracing(environ []string, cfg *runConfig, log *slog.Logger) (stop func(), err error) {
	s, err := TracingSettings(environ)
	if err != nil {
		return nil, err
	}
	stop, err = tracing.Setup(context.Background(), s, CurrentBuild().Version, cfg.Instance.ID, log)
	if err != nil {
		return nil, config.Errorf("%w", err)
	}
	if s.On {
		log.Info("tracing " + s.Describe())
	}
	return stop, nil
}
