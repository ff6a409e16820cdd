package migrate

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/migrations"
)

// Want is the schema version this binary was built for: the highest
// version among its embedded migrations (NNNNN_what.sql). A database at
// another version is one this binary's statements were not written for.
func Want() int64 {
	return wantOf(migrations.FS)
}

func wantOf(fsys fs.FS) int64 {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		panic(err) // only a malformed pattern fails
	}
	var want int64
	for _, name := range names {
		digits, _, _ := strings.Cut(name, "_")
		v, err := strconv.ParseInt(digits, 10, 64)
		if err != nil {
			panic(fmt.Sprintf("migration %s is not named NNNNN_what.sql", name)) // caught by every test
		}
		want = max(want, v)
	}
	return want
}

// Version is the database's schema version: the highest version goose
// recorded in goose_db_version (a migration rolled back removes its row),
// or 0 for a database no worker has migrated yet. One index-only read, so
// readiness can afford it every few seconds.
func Version(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var v *int64
	err := pool.QueryRow(ctx, `SELECT max(version_id) FROM goose_db_version`).Scan(&v)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable:
		return 0, nil
	case err != nil:
		return 0, err
	case v == nil:
		return 0, nil
	}
	return *v, nil
}

// MismatchError is a database whose schema version is not the one this
// binary was built for. It carries obs.CodeSchemaVersionMismatch.
type MismatchError struct {
	Found, Want int64
}

func (e *MismatchError) Error() string {
	if e.Newer() {
		return fmt.Sprintf("database schema version %d is newer than this worker's %d: a newer worker migrated it; "+
			"run a worker built for schema %d, which this one cannot migrate down to", e.Found, e.Want, e.Found)
	}
	return fmt.Sprintf("database schema version %d is older than this worker's %d: run `worker migrate` "+
		"(or start with database.migrate_on_start=true)", e.Found, e.Want)
}

// Code implements obs.Coded.
func (e *MismatchError) Code() string { return obs.CodeSchemaVersionMismatch }

// Newer reports whether the database is ahead of the binary: no start of
// this binary can fix that.
func (e *MismatchError) Newer() bool { return e.Found > e.Want }

// Check compares the database's schema version with Want: nil when they
// match, a *MismatchError when they do not.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	found, err := Version(ctx, pool)
	if err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	}
	if want := Want(); found != want {
		return &MismatchError{Found: found, Want: want}
	}
	return nil
}
