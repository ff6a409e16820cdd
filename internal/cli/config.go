package cli

import (
	"fmt"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/startup"
)

type configPrintCmd struct{}

// Run prints the configuration, then, as a YAML comment, the tracing the
// OTEL_* variables put in force. The misspelt-variable warnings go to
// stderr, as run's do: a misspelt variable is a setting that config
// print, like run, does not show.
func (configPrintCmd) Run(e *cmdEnv) error {
	cfg, _, err := startup.Prepare(e.wiring(), config.CheckAll)
	if err != nil {
		return err
	}
	s, err := startup.TracingSettings(e.Environ)
	if err != nil {
		return err
	}
	if err := config.Print(e.Stdout, cfg); err != nil {
		return err
	}
	_, err = fmt.Fprintf(e.Stdout, "# tracing (OTEL_* variables): %s\n", s.Describe())
	return err
}
