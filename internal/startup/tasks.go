package startup

import (
	"errors"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/tasks"
)

// registerGoTasks is where task kinds written in Go are added, the way Go
// jobs are added in jobs.Builtin:
//
//	if err := tasks.AddWorker(r, &SendReceiptWorker{}); err != nil { return err }
//
// See docs/tasks.md.
func registerGoTasks(*tasks.Registry) error { return nil }

// newTaskRuntime builds the River component, or a configuration error (exit
// 78) for a kind it cannot run.
func newTaskRuntime(cfg *runConfig, pool *pgxpool.Pool, log *slog.Logger, reg prometheus.Registerer) (component, error) {
	rt, err := tasks.New(tasks.Options{
		Config:     cfg.Tasks,
		Pool:       pool,
		InstanceID: cfg.Instance.ID,
		Logger:     log,
		Registerer: reg,
		Register: func(r *tasks.Registry) error {
			if err := registerGoTasks(r); err != nil || cfg.ext.Tasks == nil {
				return err
			}
			return cfg.ext.Tasks(r)
		},
	})
	var ce *tasks.ConfigError
	if errors.As(err, &ce) {
		return nil, config.Errorf("%v", ce)
	}
	return rt, err
}
