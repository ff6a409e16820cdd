package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/startup"
	"github.com/worker-dev/worker/internal/tasks"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// tasksCmd is `worker tasks ...`.
type tasksCmd struct {
	Enqueue tasksEnqueueCmd `cmd:"" help:"Enqueue a task (smoke tests, replays)."`
	List    tasksListCmd    `cmd:"" help:"List tasks, newest first."`
	Dead    struct {
		List tasksDeadListCmd `cmd:"" help:"List dead-lettered tasks (discarded, or cancelled by a permanent error), newest first."`
	} `cmd:"" help:"Inspect dead-lettered tasks."`
	Retry  tasksRetryCmd  `cmd:"" help:"Run a finished or waiting task again now."`
	Cancel tasksCancelCmd `cmd:"" help:"Cancel a task; a running one has its context cancelled."`
}

// withTasksAdmin runs f with River's admin API on the worker's database.
func withTasksAdmin(e *cmdEnv, f func(ctx context.Context, a *tasks.Admin, pool *pgxpool.Pool) error) error {
	return withPool(e, func(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
		a, err := tasks.NewAdmin(pool, log)
		if err != nil {
			return err
		}
		err = f(ctx, a, pool)
		if errors.Is(err, tasks.ErrNotFound) {
			return &startup.ExitError{Code: startup.ExitNoInput, Msg: err.Error(), Err: err}
		}
		return err
	})
}

type tasksEnqueueCmd struct {
	Kind             string `arg:"" help:"Task kind."`
	Args             string `default:"{}" help:"Args as a JSON object."`
	AllowUnknownKind bool   `help:"Enqueue a kind that neither this configuration nor a running replica knows (its task waits until a replica runs that kind)."`
	outputFlag
}

func (c tasksEnqueueCmd) Run(e *cmdEnv) error {
	if err := tasksconfig.CheckKindName(c.Kind); err != nil {
		return &startup.ExitError{Code: startup.ExitUsage, Msg: err.Error()}
	}
	if err := checkJSONArg("--args", c.Args, true); err != nil {
		return err
	}
	return withTasksAdmin(e, func(ctx context.Context, a *tasks.Admin, pool *pgxpool.Pool) error {
		if err := c.checkKnown(ctx, e.cfg, pool); err != nil {
			return err
		}
		var id int64
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			res, err := tasks.EnqueueJSON(ctx, tx, c.Kind, json.RawMessage(c.Args), nil)
			if err == nil {
				id = res.Job.ID
			}
			return err
		})
		if isDataException(err) {
			return &startup.ExitError{Code: startup.ExitUsage, Err: err, Msg: "the database refuses --args: " + err.Error()}
		}
		if err != nil {
			return err
		}
		if c.json() {
			return json.NewEncoder(e.Stdout).Encode(map[string]int64{"id": id})
		}
		fmt.Fprintf(e.Stdout, "enqueued task %d\n", id)
		return nil
	})
}

// checkKnown refuses a kind that no configuration knows, unless
// --allow-unknown-kind: no replica would run its task, which would wait for
// ever and count against its queue's max_backlog. A kind is known from
// this command's configuration (tasks.kinds) or from worker_task_kind,
// where every replica running tasks publishes its kinds, Go ones included.
func (c tasksEnqueueCmd) checkKnown(ctx context.Context, cfg *config.Config, pool *pgxpool.Pool) error {
	if c.AllowUnknownKind || slices.Contains(cfg.Tasks.KindNames(), c.Kind) {
		return nil
	}
	known, err := tasks.KnownKind(ctx, pool, c.Kind)
	if err != nil || known {
		return err
	}
	return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("task kind %q is not under tasks.kinds here, and no replica running tasks has published it: "+
		"no replica would run the task; check the name, or pass --allow-unknown-kind to enqueue it anyway", c.Kind)}
}

type tasksListCmd struct {
	State string `help:"Only tasks in this River state (available, running, retryable, scheduled, completed, discarded, cancelled, pending)."`
	Kind  string `help:"Only tasks of this kind."`
	Limit int    `default:"50" help:"Most tasks to list (at least 1)."`
	outputFlag
}

func (c tasksListCmd) Run(e *cmdEnv) error {
	if err := checkLimit(c.Limit); err != nil {
		return err
	}
	if c.State != "" {
		if err := tasks.CheckState(c.State); err != nil {
			return &startup.ExitError{Code: startup.ExitUsage, Msg: "--state: " + err.Error()}
		}
	}
	return listTasks(e, tasks.Filter{State: c.State, Kind: c.Kind, Limit: c.Limit}, c.outputFlag, "task(s)")
}

type tasksDeadListCmd struct {
	Limit int `default:"50" help:"Most tasks to list (at least 1)."`
	outputFlag
}

func (c tasksDeadListCmd) Run(e *cmdEnv) error {
	if err := checkLimit(c.Limit); err != nil {
		return err
	}
	return listTasks(e, tasks.Filter{Dead: true, Limit: c.Limit}, c.outputFlag, "dead-lettered task(s)")
}

// checkLimit refuses a --limit below 1, as `outbox dead list` does, rather
// than listing one task as if that were all.
func checkLimit(limit int) error {
	if limit < 1 {
		return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("--limit %d: want at least 1", limit)}
	}
	return nil
}

// listTasks prints the tasks f selects; the table ends with how many, in
// what, and whether --limit may have left some out.
func listTasks(e *cmdEnv, f tasks.Filter, out outputFlag, what string) error {
	return withTasksAdmin(e, func(ctx context.Context, a *tasks.Admin, _ *pgxpool.Pool) error {
		list, err := a.List(ctx, f)
		if err != nil {
			return err
		}
		return out.render(e.Stdout, jsonList(list, func(t tasks.Task) tasks.Task { return t }), func(w io.Writer) error {
			if err := tasks.PrintTable(w, list); err != nil {
				return err
			}
			if len(list) == f.Limit {
				_, err := fmt.Fprintf(w, "%d %s shown, newest first; there may be more: raise --limit\n", len(list), what)
				return err
			}
			_, err := fmt.Fprintf(w, "%d %s\n", len(list), what)
			return err
		})
	})
}

type tasksRetryCmd struct {
	ID      int64 `arg:"" optional:"" help:"Task id."`
	AllDead bool  `help:"Every dead-lettered task."`
	outputFlag
}

func (c tasksRetryCmd) Run(e *cmdEnv) error {
	if (c.ID == 0) == !c.AllDead {
		return &startup.ExitError{Code: startup.ExitUsage, Msg: "give exactly one of <id> or --all-dead"}
	}
	return withTasksAdmin(e, func(ctx context.Context, a *tasks.Admin, _ *pgxpool.Pool) error {
		if c.AllDead {
			n, err := a.RetryAllDead(ctx, operator())
			if err != nil {
				return err
			}
			if c.json() {
				return json.NewEncoder(e.Stdout).Encode(map[string]int{"retried": n})
			}
			fmt.Fprintf(e.Stdout, "retried %d task(s)\n", n)
			return nil
		}
		t, err := a.Retry(ctx, c.ID, operator())
		if err != nil {
			return err
		}
		return c.render(e.Stdout, []tasks.Task{t}, func(w io.Writer) error { return tasks.PrintTable(w, []tasks.Task{t}) })
	})
}

type tasksCancelCmd struct {
	ID int64 `arg:"" help:"Task id."`
	outputFlag
}

func (c tasksCancelCmd) Run(e *cmdEnv) error {
	return withTasksAdmin(e, func(ctx context.Context, a *tasks.Admin, _ *pgxpool.Pool) error {
		t, err := a.Cancel(ctx, c.ID, operator())
		if err != nil {
			return err
		}
		return c.render(e.Stdout, []tasks.Task{t}, func(w io.Writer) error { return tasks.PrintTable(w, []tasks.Task{t}) })
	})
}
