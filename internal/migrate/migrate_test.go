package migrate_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/migrations"
)

// Three "replicas" migrate one empty database at once: all succeed, each
// migration is recorded exactly once, and nothing is left pending.
func TestUpConcurrentReplicas(t *testing.T) {
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		pool := db.NewPool(t, 4)
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = migrate.Up(ctx, pool, slog.New(slog.DiscardHandler))
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("replica %d: %v", i, err)
		}
	}
	var dup int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT version_id FROM goose_db_version
		WHERE version_id > 0 GROUP BY version_id HAVING count(*) > 1) d`).Scan(&dup); err != nil {
		t.Fatal(err)
	}
	if dup != 0 {
		t.Fatalf("%d migrations recorded more than once", dup)
	}
	pending, err := migrate.Pending(ctx, db.Pool)
	if err != nil || pending {
		t.Fatalf("pending=%v err=%v after Up", pending, err)
	}
	// Idempotent: a second run applies nothing and fails nothing.
	if err := migrate.Up(ctx, db.Pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
}

func TestPendingOnEmptyDatabase(t *testing.T) {
	db := pgtest.NewEmpty(t)
	pending, err := migrate.Pending(context.Background(), db.Pool)
	if err != nil || !pending {
		t.Fatalf("pending=%v err=%v on an empty database", pending, err)
	}
}

// The binary's schema version is its last migration's, and a migrated
// database is at it.
func TestWantIsTheLastMigrationAndUpReachesIt(t *testing.T) {
	t.Parallel()
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil || len(names) == 0 {
		t.Fatalf("no migrations: %v", err)
	}
	last := names[len(names)-1]
	if want := migrate.Want(); !strings.HasPrefix(last, fmt.Sprintf("%05d_", want)) {
		t.Fatalf("Want() = %d, the last migration is %s", want, last)
	}
	db := pgtest.New(t)
	if err := migrate.Check(context.Background(), db.Pool); err != nil {
		t.Fatalf("Check on a migrated database: %v", err)
	}
	empty := pgtest.NewEmpty(t)
	var mm *migrate.MismatchError
	if err := migrate.Check(context.Background(), empty.Pool); !errors.As(err, &mm) || mm.Found != 0 || mm.Newer() {
		t.Fatalf("Check on an empty database = %v, want an older-schema mismatch at version 0", err)
	}
}

// A database a newer release migrated is refused before anything is
// applied: this binary cannot migrate it down.
func TestUpRefusesANewerDatabase(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	ahead := migrate.Want() + 1
	if _, err := db.Pool.Exec(ctx, `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`, ahead); err != nil {
		t.Fatal(err)
	}
	var mm *migrate.MismatchError
	err := migrate.Up(ctx, db.Pool, slog.New(slog.DiscardHandler))
	if !errors.As(err, &mm) || !mm.Newer() || mm.Found != ahead || obs.CodeOf(err) != obs.CodeSchemaVersionMismatch {
		t.Fatalf("Up on a newer database = %v, want a newer-schema mismatch coded %s", err, obs.CodeSchemaVersionMismatch)
	}
}
