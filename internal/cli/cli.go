// Package cli is the worker's command line: the kong command tree, the
// operator commands (config, jobs, outbox, inbox, tasks, healthcheck,
// version) and the one log line that reports why a command failed. The
// run and migrate commands are internal/startup's wiring, called from
// here; the adapters (sinks, sources, lock providers) are reached only
// through it.
package cli

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"

	"github.com/alecthomas/kong"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/startup"
)

type cli struct {
	Config string `help:"YAML config file. Default: ${default_config} when it exists." env:"APP_CONFIG_FILE" placeholder:"PATH" type:"path"`

	Run     runCmd     `cmd:"" default:"1" help:"Run jobs, the outbox relay, the inbox and tasks until SIGTERM (the default command)."`
	Migrate migrateCmd `cmd:"" help:"Apply database migrations (the worker's and River's) and exit. Safe to run repeatedly and from several replicas."`
	Cfg     struct {
		Print configPrintCmd `cmd:"" help:"Print the effective configuration as YAML, secrets masked."`
	} `cmd:"" name:"config" help:"Inspect configuration."`
	Jobs struct {
		List jobsListCmd `cmd:"" help:"List every job with its delay, last run, outcome, instance and next due time, cluster-wide."`
	} `cmd:"" help:"Inspect scheduled jobs."`
	Outbox struct {
		Emit  outboxEmitCmd  `cmd:"" help:"Insert one event through the producer contract (for smoke tests)."`
		Stats outboxStatsCmd `cmd:"" help:"Show event counts by status and the age of the oldest unfinished event (not yet PUBLISHED or DEAD)."`
		Dead  struct {
			List  outboxDeadListCmd  `cmd:"" help:"List DEAD events, oldest first."`
			Retry outboxDeadRetryCmd `cmd:"" help:"Requeue DEAD events as PENDING with attempts reset."`
			Purge outboxDeadPurgeCmd `cmd:"" help:"Give up on DEAD events for good: they are marked PURGED, never published, and go with their partition."`
		} `cmd:"" help:"Inspect, requeue or give up on dead-lettered events."`
	} `cmd:"" help:"Operate the transactional outbox."`
	Inbox       inboxCmd       `cmd:"" help:"Operate the inbox: dead-lettered messages and those waiting for an operator."`
	Tasks       tasksCmd       `cmd:"" help:"Operate background tasks (River)."`
	Healthcheck healthcheckCmd `cmd:"" help:"Exit 0 if the local worker's /readyz answers 200, 1 otherwise (for a container HEALTHCHECK)."`
	Version     versionCmd     `cmd:"" help:"Print the version and exit."`
}

// Main parses args, runs the chosen command and returns the exit code.
func Main(args []string, stdout, stderr io.Writer, environ []string) int {
	return run(startup.Extensions{}, args, stdout, stderr, environ)
}

// MainWith is Main for a program that embeds the worker: the same
// commands, configuration, exit codes and signals, plus ext.
func MainWith(ext startup.Extensions, args []string, stdout, stderr io.Writer, environ []string) int {
	if err := ext.Check(); err != nil {
		fmt.Fprintln(stderr, "worker:", err)
		return startup.ExitConfig
	}
	return run(ext, args, stdout, stderr, environ)
}

func run(ext startup.Extensions, args []string, stdout, stderr io.Writer, environ []string) int {
	var c cli
	exited := -1
	parser, err := kong.New(&c,
		kong.Name("worker"),
		kong.Description("Runs fixed-delay jobs, a transactional-outbox relay, an inbox and tasks beside PostgreSQL. Configure with "+config.DefaultConfigFile+" and APP_* variables."),
		kong.Vars{"default_config": config.DefaultConfigFile},
		kong.Writers(stdout, stderr),
		// kong exits on --help; record the code instead so Main returns it.
		kong.Exit(func(code int) { exited = code; panic(kongExit{}) }),
	)
	if err != nil {
		fmt.Fprintln(stderr, "worker:", err)
		return startup.ExitInternal
	}
	kctx, err := parseArgs(parser, args)
	if exited >= 0 {
		return exited
	}
	e := &cmdEnv{ConfigPath: c.Config, Stdout: stdout, Stderr: stderr, Environ: environ, ext: ext}
	if err != nil {
		// One log line like every other failure, so it carries instance_id
		// and reaches a log pipeline in the configured format. kong may
		// stop before it read APP_CONFIG_FILE.
		for _, kv := range slices.Backward(environ) {
			if v, ok := strings.CutPrefix(kv, "APP_CONFIG_FILE="); ok && e.ConfigPath == "" {
				e.ConfigPath = v
				break
			}
		}
		e.fatalLogger().Error("exiting", "error", fmt.Sprintf("%v (see worker --help)", err), "exit_code", startup.ExitUsage)
		return startup.ExitUsage
	}
	if err := kctx.Run(e); err != nil {
		code := exitCode(err)
		e.fatalLogger().Error("exiting", append(obs.ErrorAttrs(err), "exit_code", code)...)
		return code
	}
	return startup.ExitOK
}

// fatalLogger is the logger for the one line that reports why a command
// failed: the command's own, or, when it failed before building one (bad
// configuration), one in the log format that the file or environment asks
// for, JSON when that cannot be read either.
func (e *cmdEnv) fatalLogger() *slog.Logger {
	if e.log != nil {
		return e.log
	}
	log, err := obs.NewLogger(e.Stderr, config.EarlyLogFormat(e.ConfigPath, e.Environ), "info", config.EarlyInstanceID(e.ConfigPath, e.Environ))
	if err != nil {
		panic(err) // earlyLogFormat returns only formats NewLogger knows
	}
	return log
}

type kongExit struct{}

func parseArgs(p *kong.Kong, args []string) (kctx *kong.Context, err error) {
	defer func() {
		if r := recover(); r != nil {
			if _, ok := r.(kongExit); !ok {
				panic(r)
			}
			err = errors.New("exited")
		}
	}()
	return p.Parse(args)
}
