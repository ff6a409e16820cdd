package startup

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
)

// CheckLockProvider is the first half of the startup safety check and runs
// before anything connects: with APP_MULTI_INSTANCE_ENABLED=true the lock
// provider must be a shared one.
func CheckLockProvider(cfg *runConfig) error {
	if !cfg.MultiInstance.Enabled {
		return nil
	}
	switch cfg.Lock.Provider {
	case "":
		return &SafetyError{Msg: "APP_MULTI_INSTANCE_ENABLED=true but APP_LOCK_PROVIDER is not set; set APP_LOCK_PROVIDER=postgres or redis so replicas share job leases"}
	case config.ProviderInProcess:
		return &SafetyError{Msg: "APP_MULTI_INSTANCE_ENABLED=true but APP_LOCK_PROVIDER=inprocess only locks within one process; set APP_LOCK_PROVIDER=postgres or redis"}
	}
	return nil
}

// CheckLockStore is the second half: the shared provider's store must be
// usable. storeReady reports whether it is (for postgres: its table exists).
func CheckLockStore(ctx context.Context, cfg *runConfig, storeReady func(context.Context) error) error {
	if !cfg.MultiInstance.Enabled {
		return nil
	}
	if err := storeReady(ctx); err != nil {
		hint := "run `worker migrate` or set APP_DATABASE_MIGRATE_ON_START=true"
		return &SafetyError{Msg: fmt.Sprintf("APP_LOCK_PROVIDER=%s cannot be used: %v; %s", cfg.Lock.Provider, err, hint), Err: err}
	}
	return nil
}

// warnAsyncCommit warns when the database commits asynchronously for the
// worker's sessions. Lease grants and renewals rely on synchronous commit:
// with it off, a server crash could lose a grant and hand the same fencing
// token out again. It is the operator's setting to make, so a warning, not
// a refusal.
func warnAsyncCommit(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) {
	var mode string
	if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&mode); err != nil || mode != "off" {
		return
	}
	log.Warn("synchronous_commit is off for the worker's role or database; after a server crash a lease, and its fencing token, could be granted twice",
		"synchronous_commit", mode)
}
