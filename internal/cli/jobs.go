package cli

import (
	"context"
	"io"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/jobs"
)

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
