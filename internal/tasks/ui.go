package tasks

import (
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"riverqueue.com/riverui"
)

// NewUI returns River UI served under prefix. It needs a River client for
// its queries and actions, not a running one, so it works on replicas with
// tasks disabled too. Call Start on the handler before serving.
func NewUI(pool *pgxpool.Pool, prefix string, log *slog.Logger) (*riverui.Handler, error) {
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: log})
	if err != nil {
		return nil, err
	}
	return riverui.NewHandler(&riverui.HandlerOpts{
		Endpoints: riverui.NewEndpoints(client, nil),
		Logger:    log,
		Prefix:    prefix,
	})
}
