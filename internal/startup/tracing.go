package startup

import (
	"context"
	"fmt"
	"strings"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/tracing"
)

// tracingSettings reads the OTEL_* variables from the command's
// environment. A bad value is a configuration error, as for APP_*.
func tracingSettings(e *cmdEnv) (tracing.Settings, error) {
	s, err := tracing.Read(func(k string) string {
		for _, kv := range e.Environ {
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
func startTracing(e *cmdEnv, cfg *runConfig) (stop func(), err error) {
	s, err := tracingSettings(e)
	if err != nil {
		return nil, err
	}
	stop, err = tracing.Setup(context.Background(), s, currentBuild().version, cfg.Instance.ID)
	if err != nil {
		return nil, config.Errorf("%w", err)
	}
	if s.On {
		e.log.Info("tracing " + s.Describe())
	}
	return stop, nil
}

// printConfig is config print: the configuration, then, as a YAML
// comment, the tracing the OTEL_* variables put in force.
func printConfig(e *cmdEnv, cfg *runConfig) error {
	s, err := tracingSettings(e)
	if err != nil {
		return err
	}
	if err := config.Print(e.Stdout, cfg.Config); err != nil {
		return err
	}
	_, err = fmt.Fprintf(e.Stdout, "# tracing (OTEL_* variables): %s\n", s.Describe())
	return err
}
