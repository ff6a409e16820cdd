// Package migrate applies the worker's embedded SQL migrations (goose) and
// River's own migrations (rivermigrate) in one step that is safe when
// several replicas start at once.
package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/worker-dev/worker/migrations"
)

// Up applies every pending migration: the worker's own (goose), then
// River's (rivermigrate). Both run while this replica holds goose's table
// lock, a lease row judged by the database clock rather than a session
// advisory lock, so exactly one replica applies each migration and the others
// wait for it, then find nothing to do. River's migrations run one
// transaction each, because some add enum values that a later migration uses.
func Up(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) (err error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	// Goose's default retries every 5s; replicas started together should not
	// wait that long for the one applying the migrations.
	locker, err := lock.NewPostgresTableLocker(lock.WithTableLockTimeout(200*time.Millisecond, 1500))
	if err != nil {
		return err
	}
	if err := locker.Lock(ctx, db); err != nil {
		return fmt.Errorf("take migration lock: %w", err)
	}
	defer func() {
		if uerr := locker.Unlock(context.WithoutCancel(ctx), db); uerr != nil && err == nil {
			err = fmt.Errorf("release migration lock: %w", uerr)
		}
	}()

	// A newer release migrated the database: this binary knows none of
	// those migrations and cannot take them back.
	if found, err := Version(ctx, pool); err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	} else if want := Want(); found > want {
		return &MismatchError{Found: found, Want: want}
	}
	p, err := provider(db, log)
	if err != nil {
		return err
	}
	// The version before, for the summary line; this also creates goose's
	// table on an empty database, as Up would.
	workerFrom, err := p.GetDBVersion(ctx)
	if err != nil {
		return fmt.Errorf("read worker schema version: %w", err)
	}
	applied, err := upWorker(ctx, p, log)
	if err != nil {
		return err
	}
	workerTo := workerFrom
	if len(applied) > 0 {
		workerTo = applied[len(applied)-1].Source.Version
	}
	// River logs every step under its own generic message; one line per
	// applied version (below, at debug) is enough.
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	rr, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return fmt.Errorf("apply river migrations: %w", err)
	}
	for _, v := range rr.Versions {
		log.Debug("river migration applied", "version", v.Version, "name", v.Name)
	}
	existing, err := m.ExistingVersions(ctx)
	if err != nil {
		return fmt.Errorf("read river schema version: %w", err)
	}
	// River's versions are consecutive, so the one before is the last one
	// less the number applied now.
	riverTo := 0
	if len(existing) > 0 {
		riverTo = existing[len(existing)-1].Version
	}
	// One line, so that a first start's log does not open with a screen of
	// migrations; the per-migration lines are at debug.
	log.Info("migrations applied", "count", len(applied)+len(rr.Versions),
		"worker_count", len(applied), "worker_version_from", workerFrom, "worker_version_to", workerTo,
		"river_count", len(rr.Versions), "river_version_from", riverTo-len(rr.Versions), "river_version_to", riverTo)
	return nil
}

// lockAttempts bounds how often a migration that could not take its lock
// in time (its lock_timeout) is tried again. The outbox V2 cutover locks
// outbox_event, which a long transaction of an application or an old relay
// may hold; failing fast and retrying keeps producers from queueing behind
// the cutover's wait for long.
const lockAttempts = 30

// upWorker applies the worker's migrations, retrying one that gave up
// waiting for a lock. Goose records each migration as it commits, so a
// retry resumes at the one that failed, whose transaction rolled back whole.
// It returns the migrations applied, in order.
func upWorker(ctx context.Context, p *goose.Provider, log *slog.Logger) ([]*goose.MigrationResult, error) {
	var applied []*goose.MigrationResult
	for attempt := 1; ; attempt++ {
		res, err := p.Up(ctx)
		if partial := (*goose.PartialError)(nil); errors.As(err, &partial) {
			res = partial.Applied
		}
		for _, r := range res {
			log.Debug("migration applied", "version", r.Source.Version, "file", r.Source.Path, "duration_ms", r.Duration.Milliseconds())
		}
		applied = append(applied, res...)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != pgerrcode.LockNotAvailable || attempt == lockAttempts {
			if err != nil {
				return applied, fmt.Errorf("apply worker migrations: %w", err)
			}
			return applied, nil
		}
		log.Warn("migration waiting for a lock; trying again", "attempt", attempt, "error", err)
		select {
		case <-ctx.Done():
			return applied, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// Pending reports whether any worker or River migration is not yet applied.
// It takes no lock and writes nothing, so /readyz can call it.
func Pending(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := provider(db, slog.New(slog.DiscardHandler))
	if err != nil {
		return false, err
	}
	pending, err := p.HasPending(ctx)
	if err != nil || pending {
		return pending, err
	}
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return false, err
	}
	existing, err := m.ExistingVersions(ctx)
	if err != nil {
		var pgErr interface{ SQLState() string }
		if errors.As(err, &pgErr) && pgErr.SQLState() == "42P01" { // river_migration missing
			return true, nil
		}
		return false, err
	}
	all := m.AllVersions()
	return len(existing) == 0 || existing[len(existing)-1].Version < all[len(all)-1].Version, nil
}

func provider(db *sql.DB, log *slog.Logger) (*goose.Provider, error) {
	return goose.NewProvider(goose.DialectPostgres, db, migrations.FS, goose.WithSlog(log), goose.WithDisableGlobalRegistry(true))
}
