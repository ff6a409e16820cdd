package cli

import (
	"context"
	"io"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/startup"
)

// cmdEnv is what a command needs from the process, injectable for tests.
type cmdEnv struct {
	ConfigPath string
	Stdout     io.Writer
	Stderr     io.Writer
	Environ    []string

	ext startup.Extensions // what an embedding program adds

	log *slog.Logger   // set once the command has built its logger
	cfg *config.Config // set once an operator command has loaded its configuration
}

// wiring is e as startup takes it; the logger startup builds comes back
// to e, for the line that reports a failure.
func (e *cmdEnv) wiring() startup.Env {
	return startup.Env{ConfigPath: e.ConfigPath, Stdout: e.Stdout, Stderr: e.Stderr, Environ: e.Environ, Ext: e.ext,
		OnLogger: func(log *slog.Logger) { e.log = log }}
}

// loadConfig reads the configuration with the command's extensions,
// checking what the command needs.
func (e *cmdEnv) loadConfig(level config.Level) (*config.Config, error) {
	return startup.ReadConfig(e.wiring(), level)
}

// withPool runs an operator command that needs only the database: the
// configuration is checked as far as such a command uses it
// (config.CheckDatabase), and is e.cfg while f runs.
func withPool(e *cmdEnv, f func(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error) error {
	return startup.WithDB(e.wiring(), config.CheckDatabase, func(ctx context.Context, pool *pgxpool.Pool, cfg *config.Config, log *slog.Logger) error {
		e.cfg = cfg
		return f(ctx, pool, log)
	})
}
