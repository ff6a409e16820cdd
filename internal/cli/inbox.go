package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/startup"
)

// inboxCmd is `worker inbox ...` (docs/inbox.md, "Operating").
type inboxCmd struct {
	Stats inboxStatsCmd `cmd:"" help:"Show message counts by source and state, the oldest unfinished claim, and what waits for an operator."`
	Dead  struct {
		List  inboxDeadListCmd  `cmd:"" help:"List DEAD messages, oldest first."`
		Retry inboxDeadRetryCmd `cmd:"" help:"Requeue DEAD messages with attempts reset; a running replica processes them within inbox.lease_ttl/2."`
		Purge inboxDeadPurgeCmd `cmd:"" help:"Delete DEAD messages for good (the rows go); a redelivery of one is then a new message."`
	} `cmd:"" help:"Inspect, requeue or delete dead-lettered messages."`
	Recovery struct {
		List    inboxRecoveryListCmd    `cmd:"" help:"List RECOVERY_REQUIRED messages (their processing lease expired before their work committed), oldest first."`
		Retry   inboxRecoveryRetryCmd   `cmd:"" help:"Requeue RECOVERY_REQUIRED messages, attempts kept, once you checked their work must run again."`
		Resolve inboxRecoveryResolveCmd `cmd:"" help:"Mark RECOVERY_REQUIRED messages RESOLVED, once you checked their work was done or is not needed."`
	} `cmd:"" help:"Decide about messages whose work may have been cut off."`
}

type inboxStatsCmd struct {
	Source string `help:"Only this inbox source (inbox.sources[].name)." placeholder:"NAME"`
	outputFlag
}

func (c inboxStatsCmd) Run(e *cmdEnv) error {
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, _ *slog.Logger) error {
		var names []string
		for _, s := range e.cfg.Inbox.Sources {
			names = append(names, s.Name)
		}
		st, err := inbox.ReadStats(ctx, pool, names, c.Source)
		if err != nil {
			return err
		}
		return c.render(e.Stdout, st.JSON(), func(w io.Writer) error { return inbox.PrintStats(w, st) })
	})
}

// inboxList is what `dead list` and `recovery list` take.
type inboxList struct {
	Source string `help:"Only messages of this inbox source (inbox.sources[].name)." placeholder:"NAME"`
	Limit  int    `default:"50" help:"Most messages to list (at least 1)."`
	outputFlag
}

type inboxDeadListCmd struct{ inboxList }

func (c inboxDeadListCmd) Run(e *cmdEnv) error { return c.list(e, inbox.StateDead) }

type inboxRecoveryListCmd struct{ inboxList }

func (c inboxRecoveryListCmd) Run(e *cmdEnv) error { return c.list(e, inbox.StateRecoveryRequired) }

func (c inboxList) list(e *cmdEnv, state string) error {
	if err := checkLimit(c.Limit); err != nil {
		return err
	}
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, _ *slog.Logger) error {
		list, total, err := inbox.List(ctx, pool, state, inbox.Selection{Source: c.Source}, c.Limit)
		if err != nil {
			return err
		}
		return c.render(e.Stdout, jsonList(list, inbox.Entry.JSON), func(w io.Writer) error { return inbox.PrintEntries(w, state, list, total) })
	})
}

// inboxSelection names the messages an operator command acts on: one
// message, or every one in the command's state, of one source or all.
type inboxSelection struct {
	MsgID     string `arg:"" optional:"" name:"msg_id" help:"msg_id of the message: its CloudEvents id, or its configured key's value."`
	All       bool   `help:"Every such message (of --source, when given)."`
	Source    string `help:"Only messages of this inbox source (inbox.sources[].name)." placeholder:"NAME"`
	MsgSource string `help:"Only messages from this CloudEvents source, when one msg_id names several." placeholder:"URI"`
}

func (s inboxSelection) validate() error {
	if (s.MsgID == "") == !s.All {
		return &startup.ExitError{Code: startup.ExitUsage, Msg: "give exactly one of <msg_id> or --all"}
	}
	return nil
}

func (s inboxSelection) selection() inbox.Selection {
	return inbox.Selection{Source: s.Source, MsgSource: s.MsgSource, ID: s.MsgID}
}

// inboxAction runs one of inbox's operator functions on sel and reports
// the count with verb; list names the command that shows the messages.
func inboxAction(e *cmdEnv, sel inboxSelection, verb, list string,
	act func(context.Context, *pgxpool.Pool, inbox.Selection, string, *slog.Logger) (int64, error)) error {
	if err := sel.validate(); err != nil {
		return err
	}
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
		n, err := act(ctx, pool, sel.selection(), operator(), log)
		var (
			notFound  *inbox.NotFoundError
			ambiguous *inbox.AmbiguousError
			unkeyed   *inbox.UnkeyedError
			left      *inbox.UnkeyedLeftError
		)
		switch {
		case errors.As(err, &notFound):
			return &startup.ExitError{Code: startup.ExitNoInput, Err: err, Msg: fmt.Sprintf("%s; `%s` shows them", strings.TrimPrefix(err.Error(), "inbox: "), list)}
		case errors.As(err, &ambiguous):
			return &startup.ExitError{Code: startup.ExitUsage, Err: err, Msg: strings.TrimPrefix(err.Error(), "inbox: ") + ": name one with --source and --msg-source"}
		case errors.As(err, &unkeyed):
			return &startup.ExitError{Code: startup.ExitDataErr, Err: err, Msg: strings.TrimPrefix(err.Error(), "inbox: ") +
				": run again, it would still have none; fix the sender or inbox.sources[].key, have it sent again, and purge this one (`worker inbox dead purge " + sel.MsgID + "`)"}
		case errors.As(err, &left):
			fmt.Fprintf(e.Stdout, "%s %d message(s); %d left DEAD because they have no dedupe key: purge them\n", verb, n, left.Left)
			return nil
		case err != nil:
			return err
		}
		fmt.Fprintf(e.Stdout, "%s %d message(s)\n", verb, n)
		return nil
	})
}

type inboxDeadRetryCmd struct{ inboxSelection }

func (c inboxDeadRetryCmd) Run(e *cmdEnv) error {
	return inboxAction(e, c.inboxSelection, "requeued", "worker inbox dead list", inbox.RetryDead)
}

type inboxDeadPurgeCmd struct{ inboxSelection }

func (c inboxDeadPurgeCmd) Run(e *cmdEnv) error {
	return inboxAction(e, c.inboxSelection, "purged", "worker inbox dead list", inbox.PurgeDead)
}

type inboxRecoveryRetryCmd struct{ inboxSelection }

func (c inboxRecoveryRetryCmd) Run(e *cmdEnv) error {
	return inboxAction(e, c.inboxSelection, "requeued", "worker inbox recovery list", inbox.RetryRecovery)
}

type inboxRecoveryResolveCmd struct{ inboxSelection }

func (c inboxRecoveryResolveCmd) Run(e *cmdEnv) error {
	return inboxAction(e, c.inboxSelection, "resolved", "worker inbox recovery list", inbox.ResolveRecovery)
}
