package cli

import "github.com/worker-dev/worker/internal/startup"

// runCmd and migrateCmd are the wiring's own: startup builds and runs the
// parts.
type (
	runCmd     struct{}
	migrateCmd struct{}
)

func (runCmd) Run(e *cmdEnv) error { return startup.Run(e.wiring()) }

func (migrateCmd) Run(e *cmdEnv) error { return startup.Migrate(e.wiring()) }
