package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/startup"
)

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
			return &startup.ExitError{Code: startup.ExitUsage, Msg: f.flag + " is empty; give a value"}
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
			return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("the event breaks a rule of outbox_event (%s): %s", ruleErr.Constraint, ruleErr.Problem)}
		case errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "23"):
			return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("the event breaks a rule of outbox_event (%s): %s", pgErr.ConstraintName, pgErr.Message)}
		case isDataException(err):
			return &startup.ExitError{Code: startup.ExitUsage, Err: err, Msg: "the database refuses the event's data: " + pgErr.Message}
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
		return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("--limit %d: want at least 1", c.Limit)}
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
		return &startup.ExitError{Code: startup.ExitUsage, Msg: "give exactly one of <event_id> or --all"}
	}
	if d.EventID != "" {
		if _, err := uuid.Parse(d.EventID); err != nil {
			return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("%q is not an event_id (uuid)", d.EventID)}
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
			return &startup.ExitError{Code: startup.ExitNoInput, Err: err, Msg: fmt.Sprintf("no DEAD event with event_id %s; `worker outbox dead list` shows them", sel.EventID)}
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
			return &startup.ExitError{Code: startup.ExitUsage, Msg: flag + " is not a JSON object"}
		}
	}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return &startup.ExitError{Code: startup.ExitUsage, Msg: flag + " is not valid JSON: " + err.Error()}
		}
		if s, ok := tok.(string); ok && strings.ContainsRune(s, 0) {
			return &startup.ExitError{Code: startup.ExitUsage, Msg: flag + ` holds \u0000 (NUL) in a string, which PostgreSQL's jsonb cannot store`}
		}
	}
	if !json.Valid([]byte(value)) { // the token stream accepts "1 2", and "{" alone
		return &startup.ExitError{Code: startup.ExitUsage, Msg: flag + " is not valid JSON"}
	}
	return nil
}

// isDataException is PostgreSQL refusing a value (SQLSTATE class 22: bad
// text encoding, a number out of range, an unsupported escape in JSON).
func isDataException(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "22")
}
