package startup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/obs"
)

// What the commands of internal/cli call: Run (run.go) and Migrate, and
// for the operator commands the configuration, the logger and a bounded
// database connection, each as run has them.

// Env is what a command takes from the process that runs it: internal/cli
// fills it from the command line, tests with buffers.
type Env struct {
	ConfigPath string
	Stdout     io.Writer
	Stderr     io.Writer
	Environ    []string
	Ext        Extensions // what an embedding program adds

	// OnLogger, when set, is given the command's logger as soon as it is
	// built from the configuration, so that the caller reports a failure
	// in the same log format and with the same instance_id.
	OnLogger func(*slog.Logger)
}

// ReadConfig reads the configuration with e's extensions and checks what a
// command of the given level needs.
func ReadConfig(e Env, level config.Level) (*config.Config, error) {
	cfg, err := e.loadConfig(level)
	if err != nil {
		return nil, err
	}
	return cfg.Config, nil
}

// Prepare is how a command starts that works from the whole configuration:
// read it at level, build the logger it names, and warn about misspelt
// APP_* variables.
func Prepare(e Env, level config.Level) (*config.Config, *slog.Logger, error) {
	cfg, log, err := e.prepare(level)
	if err != nil {
		return nil, nil, err
	}
	return cfg.Config, log, nil
}

// prepare is Prepare keeping the extensions with the configuration.
func (e Env) prepare(level config.Level) (*runConfig, *slog.Logger, error) {
	cfg, err := e.loadConfig(level)
	if err != nil {
		return nil, nil, err
	}
	log, err := newLogger(e, cfg)
	if err != nil {
		return nil, nil, err
	}
	warnMisspeltEnv(log, cfg)
	return cfg, log, nil
}

func (e Env) loadConfig(level config.Level) (*runConfig, error) {
	return readConfig(e.ConfigPath, e.Environ, e.Ext, level)
}

// Migrate is `worker migrate`. It checks the whole configuration, as Run
// does: migrate is the step before a rollout, where a mistake is cheapest
// to find.
func Migrate(e Env) error {
	return withPool(e, config.CheckAll, func(ctx context.Context, pool *pgxpool.Pool, cfg *runConfig, log *slog.Logger) error {
		if err := migrate.Up(ctx, pool, log); err != nil {
			return migrateError(cfg, err)
		}
		log.Info("migrations current")
		return nil
	})
}

// migrateError is err from migrate.Up: exit 78 for a database a newer
// release migrated (see checkSchemaAhead), else the error as it is.
func migrateError(cfg *runConfig, err error) error {
	var mm *migrate.MismatchError
	if errors.As(err, &mm) && mm.Newer() {
		return schemaAheadError(cfg, mm)
	}
	return fmt.Errorf("migrations: %w", err)
}

// WithDB runs an operator command that needs the database: load the
// configuration, checking level of it, connect (bounded, like Run), call
// f, close. A signal cancels f's ctx and makes the error an interrupted
// command's (exit 1).
func WithDB(e Env, level config.Level, f func(ctx context.Context, pool *pgxpool.Pool, cfg *config.Config, log *slog.Logger) error) error {
	return withPool(e, level, func(ctx context.Context, pool *pgxpool.Pool, cfg *runConfig, log *slog.Logger) error {
		return f(ctx, pool, cfg.Config, log)
	})
}

// withPool is WithDB giving f the configuration with the extensions.
func withPool(e Env, level config.Level, f func(ctx context.Context, pool *pgxpool.Pool, cfg *runConfig, log *slog.Logger) error) error {
	cfg, log, err := e.prepare(level)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	pool, err := connectDB(ctx, cfg, log)
	if err == nil {
		defer pool.Close()
		err = f(ctx, pool, cfg, log)
	}
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("%w: %w", errInterrupted, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return &ExitError{Code: ExitNoInput, Err: err, Msg: fmt.Sprintf("database %s has no worker tables (%s); run `worker migrate` or check APP_DATABASE_URL",
			obs.MaskDSN(cfg.Database.URL), pgErr.Message)}
	}
	return err
}
