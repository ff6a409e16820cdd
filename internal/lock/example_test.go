package lock_test

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/lock"
)

// rebuildReport is the example of docs/lock.md ("Using it"), kept here so
// that it builds with the package: code that holds a lease outside the
// scheduler fences its transaction by hand. Nothing calls it.
func rebuildReport(ctx context.Context, locker lock.Locker, pool *pgxpool.Pool, data []byte) error {
	lease, err := locker.TryAcquire(ctx, "rebuild-report", 0, 30*time.Second)
	if lock.IsTimeout(err) {
		return nil // another replica is on it
	} else if err != nil {
		return err
	}
	// Release on every path, or the heartbeat keeps the lease held. Deferred
	// first, it runs last: after the commit or the rollback below. It runs on
	// a context that shutdown has not cancelled, with a bound of its own.
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = lease.Release(rctx)
	}()
	work, done := lock.WithLease(ctx, lease) // cancelled if the lease is lost
	defer done()

	tx, err := pool.Begin(work)
	if err != nil {
		return err
	}
	// Rolls back unless committed; a no-op after the commit.
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(work, `UPDATE report SET data = $1 WHERE id = 1`, data); err != nil {
		return err
	}
	if err := lease.Fence(work, tx); err != nil { // last statement before COMMIT
		return err
	}
	// Commit on a context that the lease's loss does not cancel: once the
	// fence passed, the commit is safe, and cancelling it midway would leave
	// you not knowing whether it happened. (pgx.BeginFunc(work, ...) would
	// commit on work.)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	return tx.Commit(cctx)
}
