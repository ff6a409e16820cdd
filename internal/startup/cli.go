package startup

import (
	"errors"
	"fmt"
	"io"
	"runtime/debug"

	"github.com/alecthomas/kong"
)

// Version is set at build time with -ldflags "-X worker/internal/startup.Version=...".
var Version = "dev"

// cmdEnv is what a command needs from the process, injectable for tests.
type cmdEnv struct {
	ConfigPath string
	Stdout     io.Writer
	Stderr     io.Writer
	Environ    []string
}

type cli struct {
	Config string `help:"YAML config file. Default: ${default_config} when it exists." env:"APP_CONFIG_FILE" placeholder:"PATH" type:"path"`

	Run     runCmd     `cmd:"" default:"1" help:"Run jobs and the outbox relay until SIGTERM (the default command)."`
	Migrate migrateCmd `cmd:"" help:"Apply database migrations (the worker's and River's) and exit. Safe to run repeatedly and from several replicas."`
	Cfg     struct {
		Print configPrintCmd `cmd:"" help:"Print the effective configuration as YAML, secrets masked."`
	} `cmd:"" name:"config" help:"Inspect configuration."`
	Version versionCmd `cmd:"" help:"Print the version and exit."`
}

// Main parses args, runs the chosen command and returns the exit code.
func Main(args []string, stdout, stderr io.Writer, environ []string) int {
	var c cli
	exited := -1
	parser, err := kong.New(&c,
		kong.Name("worker"),
		kong.Description("Runs fixed-delay jobs and a transactional-outbox relay beside PostgreSQL. Configure with "+DefaultConfigFile+" and APP_* variables."),
		kong.Vars{"default_config": DefaultConfigFile},
		kong.Writers(stdout, stderr),
		// kong exits on --help; record the code instead so Main returns it.
		kong.Exit(func(code int) { exited = code; panic(kongExit{}) }),
	)
	if err != nil {
		fmt.Fprintln(stderr, "worker:", err)
		return ExitInternal
	}
	kctx, err := parseArgs(parser, args)
	if exited >= 0 {
		return exited
	}
	if err != nil {
		fmt.Fprintf(stderr, "worker: %v (see worker --help)\n", err)
		return ExitUsage
	}
	e := &cmdEnv{ConfigPath: c.Config, Stdout: stdout, Stderr: stderr, Environ: environ}
	if err := kctx.Run(e); err != nil {
		fmt.Fprintln(stderr, "worker:", err)
		return ExitCode(err)
	}
	return ExitOK
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

type versionCmd struct{}

func (versionCmd) Run(e *cmdEnv) error {
	v := Version
	if bi, ok := debug.ReadBuildInfo(); ok && v == "dev" {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				v = "dev-" + s.Value
			}
		}
	}
	fmt.Fprintln(e.Stdout, "worker", v)
	return nil
}

type configPrintCmd struct{}

func (configPrintCmd) Run(e *cmdEnv) error {
	cfg, err := LoadConfig(e.ConfigPath, e.Environ)
	if err != nil {
		return err
	}
	return PrintConfig(e.Stdout, cfg)
}
