package startup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/obs"
)

// schemaCheckEvery is how often a running replica reads the database's
// schema version (one index-only read on the probe pool): how late it
// notices that another release migrated the database, or rolled it back.
const schemaCheckEvery = 5 * time.Second

// schemaGuard keeps a running replica honest about its schema: each
// release's statements are written for one schema version (migrate.Want),
// and a replica whose database is at another one, newer after a newer
// release migrated it, older after a rollback, is not ready. It logs one
// ERROR (SCHEMA_VERSION_MISMATCH) when a mismatch starts and one INFO when
// it ends, not one per check.
type schemaGuard struct {
	pool *pgxpool.Pool // the readiness probe's pool, never the relay's
	log  *slog.Logger

	mu       sync.Mutex
	mismatch *migrate.MismatchError // nil: the versions match
	stop     context.CancelFunc
	done     chan struct{}
}

// Ready implements readyReporter.
func (g *schemaGuard) Ready() (bool, string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.mismatch == nil {
		return true, ""
	}
	return false, fmt.Sprintf("schema version %d, this worker needs %d", g.mismatch.Found, g.mismatch.Want)
}

// check reads the version once. A database that does not answer keeps the
// last verdict: the readiness ping reports that on its own.
func (g *schemaGuard) check(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	err := migrate.Check(ctx, g.pool)
	var mm *migrate.MismatchError
	if err != nil && !errors.As(err, &mm) {
		return
	}
	g.mu.Lock()
	prev := g.mismatch
	g.mismatch = mm
	g.mu.Unlock()
	switch {
	case mm != nil && (prev == nil || *prev != *mm):
		g.log.Error("database schema version is not this worker's; not ready",
			"error.code", obs.CodeSchemaVersionMismatch, "schema_version", mm.Found, "schema_version_needed", mm.Want, "error", mm.Error())
	case mm == nil && prev != nil:
		g.log.Info("database schema version is this worker's again; ready", "schema_version", migrate.Want())
	}
}

// start checks at once, then every schemaCheckEvery until shutdown.
func (g *schemaGuard) start() {
	ctx, stop := context.WithCancel(context.Background())
	g.stop, g.done = stop, make(chan struct{})
	g.check(ctx)
	go func() {
		defer close(g.done)
		t := time.NewTicker(schemaCheckEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				g.check(ctx)
			}
		}
	}()
}

func (g *schemaGuard) shutdown() {
	if g.stop != nil {
		g.stop()
		<-g.done
	}
}

// checkSchemaAhead refuses to start against a database that a newer
// release migrated: this binary cannot migrate it down, and its
// statements were not written for it, so no retry can succeed. Exit 78:
// the deployment is misconfigured (an old image, or database.url pointing
// at another deployment's database), as sysexits' EX_CONFIG means. An
// older database is migrated (database.migrate_on_start) or waited for.
func checkSchemaAhead(ctx context.Context, pool *pgxpool.Pool, cfg *runConfig) error {
	found, err := migrate.Version(ctx, pool)
	if err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	}
	if want := migrate.Want(); found > want {
		return schemaAheadError(cfg, &migrate.MismatchError{Found: found, Want: want})
	}
	return nil
}

// schemaAheadError is the exit-78 error for a database newer than the
// binary; it keeps the code SCHEMA_VERSION_MISMATCH for the exit line.
func schemaAheadError(cfg *runConfig, mm *migrate.MismatchError) error {
	return &config.Error{Err: mm, Msg: fmt.Sprintf("database.url (APP_DATABASE_URL) %s: %s",
		obs.MaskDSN(cfg.Database.URL), mm.Error())}
}
