package startup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/user"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/alecthomas/kong"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/jobs"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox"
)

// Version is set at build time with -ldflags "-X github.com/worker-dev/worker/internal/startup.Version=...".
var Version = "dev"

// cmdEnv is what a command needs from the process, injectable for tests.
type cmdEnv struct {
	ConfigPath string
	Stdout     io.Writer
	Stderr     io.Writer
	Environ    []string

	ext Extensions // what an embedding program adds

	log *slog.Logger // set once the command has built its logger
	cfg *runConfig   // set once an operator command has loaded its configuration
}

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
	return run(Extensions{}, args, stdout, stderr, environ)
}

func run(ext Extensions, args []string, stdout, stderr io.Writer, environ []string) int {
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
		return ExitInternal
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
		e.fatalLogger().Error("exiting", "error", fmt.Sprintf("%v (see worker --help)", err), "exit_code", ExitUsage)
		return ExitUsage
	}
	if err := kctx.Run(e); err != nil {
		code := ExitCode(err)
		e.fatalLogger().Error("exiting", append(obs.ErrorAttrs(err), "exit_code", code)...)
		return code
	}
	return ExitOK
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

type configPrintCmd struct{}

func (configPrintCmd) Run(e *cmdEnv) error {
	cfg, err := e.loadConfig(config.CheckAll)
	if err != nil {
		return err
	}
	// The warnings go to stderr, as run's do: a misspelt variable is a
	// setting that config print, like run, does not show.
	log, err := newLogger(e, cfg)
	if err != nil {
		return err
	}
	warnMisspeltEnv(log, cfg)
	return printConfig(e, cfg)
}

type jobsListCmd struct{ outputFlag }

func (c jobsListCmd) Run(e *cmdEnv) error {
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, _ *slog.Logger) error {
		list, err := jobs.List(ctx, pool)
		if err != nil {
			return err
		}
		return c.render(e.Stdout, jsonList(list, jobs.Status.JSON), func(w io.Writer) error { return jobs.PrintList(w, list) })
	})
}

type outboxEmitCmd struct {
	AggregateType string `required:"" help:"Aggregate type, e.g. order."`
	AggregateID   string `required:"" help:"Aggregate id, e.g. 42."`
	EventType     string `required:"" help:"Event type, e.g. order.paid."`
	Payload       string `default:"{}" help:"JSON payload."`
}

func (c outboxEmitCmd) Run(e *cmdEnv) error {
	for _, f := range []struct{ flag, v string }{
		{"--aggregate-type", c.AggregateType}, {"--aggregate-id", c.AggregateID}, {"--event-type", c.EventType},
	} {
		if strings.TrimSpace(f.v) == "" {
			return &exitError{code: ExitUsage, msg: f.flag + " is empty; give a value"}
		}
	}
	if err := checkJSONArg("--payload", c.Payload, false); err != nil {
		return err
	}
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, _ *slog.Logger) error {
		id, err := outbox.Emit(ctx, pool, outbox.NewEvent{AggregateType: c.AggregateType, AggregateID: c.AggregateID,
			EventType: c.EventType, Payload: json.RawMessage(c.Payload)})
		// The producer rules, checked before the insert, and any other
		// constraint of the table name the rule the event breaks.
		var ruleErr *outbox.RuleError
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &ruleErr):
			return &exitError{code: ExitUsage, msg: fmt.Sprintf("the event breaks a rule of outbox_event (%s): %s", ruleErr.Constraint, ruleErr.Problem)}
		case errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "23"):
			return &exitError{code: ExitUsage, msg: fmt.Sprintf("the event breaks a rule of outbox_event (%s): %s", pgErr.ConstraintName, pgErr.Message)}
		case isDataException(err):
			return &exitError{code: ExitUsage, err: err, msg: "the database refuses the event's data: " + pgErr.Message}
		}
		if err != nil {
			return err
		}
		fmt.Fprintln(e.Stdout, id)
		return nil
	})
}

type outboxStatsCmd struct{ outputFlag }

func (c outboxStatsCmd) Run(e *cmdEnv) error {
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, _ *slog.Logger) error {
		st, err := outbox.ReadStats(ctx, pool)
		if err != nil {
			return err
		}
		return c.render(e.Stdout, st.JSON(), func(w io.Writer) error { return outbox.PrintStats(w, st) })
	})
}

type outboxDeadListCmd struct {
	Limit int `default:"50" help:"Most events to list (at least 1)."`
	outputFlag
}

func (c outboxDeadListCmd) Run(e *cmdEnv) error {
	if c.Limit < 1 {
		return &exitError{code: ExitUsage, msg: fmt.Sprintf("--limit %d: want at least 1", c.Limit)}
	}
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, _ *slog.Logger) error {
		list, total, err := outbox.ListDead(ctx, pool, c.Limit)
		if err != nil {
			return err
		}
		return c.render(e.Stdout, jsonList(list, outbox.DeadEvent.JSON), func(w io.Writer) error { return printDead(w, list, total) })
	})
}

// deadSelection names the DEAD events an operator command acts on: one
// event, or every one.
type deadSelection struct {
	EventID string `arg:"" optional:"" help:"event_id of the DEAD event."`
	All     bool   `help:"Every DEAD event."`
}

func (d deadSelection) validate() error {
	if (d.EventID == "") == !d.All {
		return &exitError{code: ExitUsage, msg: "give exactly one of <event_id> or --all"}
	}
	if d.EventID != "" {
		if _, err := uuid.Parse(d.EventID); err != nil {
			return &exitError{code: ExitUsage, msg: fmt.Sprintf("%q is not an event_id (uuid)", d.EventID)}
		}
	}
	return nil
}

// deadAction runs one of outbox's DEAD-event admin functions on sel and
// reports the count with verb.
func deadAction(e *cmdEnv, sel deadSelection, verb string,
	act func(context.Context, *pgxpool.Pool, string, string, *slog.Logger) (int64, error)) error {
	if err := sel.validate(); err != nil {
		return err
	}
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
		n, err := act(ctx, pool, sel.EventID, operator(), log)
		switch {
		case errors.Is(err, outbox.ErrNotDead):
			return &exitError{code: ExitNoInput, err: err, msg: fmt.Sprintf("no DEAD event with event_id %s; `worker outbox dead list` shows them", sel.EventID)}
		case err != nil:
			return err
		}
		fmt.Fprintf(e.Stdout, "%s %d event(s)\n", verb, n)
		return nil
	})
}

type outboxDeadRetryCmd struct{ deadSelection }

func (c outboxDeadRetryCmd) Run(e *cmdEnv) error {
	return deadAction(e, c.deadSelection, "requeued", outbox.RetryDead)
}

type outboxDeadPurgeCmd struct{ deadSelection }

func (c outboxDeadPurgeCmd) Run(e *cmdEnv) error {
	return deadAction(e, c.deadSelection, "purged", outbox.PurgeDead)
}

// operator names who ran a command, for the audit line.
func operator() string {
	who := "unknown"
	if u, err := user.Current(); err == nil {
		who = u.Username
	}
	host, _ := os.Hostname()
	return who + "@" + host
}

// printDead writes the listed DEAD events as a table, then how many there
// are in all and, when some are not shown, how to see them.
func printDead(w io.Writer, list []outbox.DeadEvent, total int64) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EVENT ID\tAGGREGATE\tEVENT TYPE\tATTEMPTS\tDEAD AT\tLAST ERROR")
	for _, d := range list {
		fmt.Fprintf(tw, "%s\t%s/%s\t%s\t%d\t%s\t%s\n", d.EventID, d.AggregateType, d.AggregateID, d.EventType,
			d.Attempts, d.DeadAt.UTC().Format(time.RFC3339), strings.Join(strings.Fields(d.LastError), " "))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if int64(len(list)) < total {
		_, err := fmt.Fprintf(w, "%d of %d DEAD events shown, oldest first; see more with --limit %d\n", len(list), total, total)
		return err
	}
	_, err := fmt.Fprintf(w, "%d DEAD event(s)\n", total)
	return err
}

// checkJSONArg refuses a flag's value that is not JSON (not a JSON object
// when object is set), or that holds a NUL character (\u0000) in a string:
// PostgreSQL's jsonb cannot store one, and its refusal is the operator's
// mistake (exit 64), not an internal error.
func checkJSONArg(flag, value string, object bool) error {
	dec := json.NewDecoder(strings.NewReader(value))
	if object {
		if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
			return &exitError{code: ExitUsage, msg: flag + " is not a JSON object"}
		}
	}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return &exitError{code: ExitUsage, msg: flag + " is not valid JSON: " + err.Error()}
		}
		if s, ok := tok.(string); ok && strings.ContainsRune(s, 0) {
			return &exitError{code: ExitUsage, msg: flag + ` holds \u0000 (NUL) in a string, which PostgreSQL's jsonb cannot store`}
		}
	}
	if !json.Valid([]byte(value)) { // the token stream accepts "1 2", and "{" alone
		return &exitError{code: ExitUsage, msg: flag + " is not valid JSON"}
	}
	return nil
}

// isDataException is PostgreSQL refusing a value (SQLSTATE class 22: bad
// text encoding, a number out of range, an unsupported escape in JSON).
func isDataException(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "22")
}

// loadConfig is LoadConfig with the command's extensions, checking what
// the command needs.
func (e *cmdEnv) loadConfig(level config.Level) (*runConfig, error) {
	return readConfig(e.ConfigPath, e.Environ, e.ext, level)
}
