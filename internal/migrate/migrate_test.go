package migrate_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

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

// At info, a first start logs its migrations as one line: how many, and
// from which version to which, for the worker's and River's. At debug,
// each migration has its line too. A start with nothing to do logs the
// same line with zero applied.
func TestUpLogsOneSummaryLineUnlessDebug(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	files, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("no migration files (%v)", err)
	}
	m, err := rivermigrate.New(riverpgxv5.New(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	riverAll := m.AllVersions()
	riverLast := riverAll[len(riverAll)-1].Version
	lastFile := files[len(files)-1]
	var workerLast int64
	for _, c := range lastFile {
		if c < '0' || c > '9' {
			break
		}
		workerLast = workerLast*10 + int64(c-'0')
	}

	up := func(db *pgtest.DB, level slog.Level) []map[string]any {
		t.Helper()
		var buf bytes.Buffer
		log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: level}))
		if err := migrate.Up(ctx, db.Pool, log); err != nil {
			t.Fatal(err)
		}
		var lines []map[string]any
		for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
			var line map[string]any
			if err := json.Unmarshal([]byte(l), &line); err != nil {
				t.Fatalf("not a JSON line: %q", l)
			}
			lines = append(lines, line)
		}
		return lines
	}
	summary := func(line map[string]any, count, worker int, wFrom, wTo int64, river, rFrom, rTo int) {
		t.Helper()
		want := map[string]any{"level": "INFO", "msg": "migrations applied", "count": count,
			"worker_count": worker, "worker_version_from": wFrom, "worker_version_to": wTo,
			"river_count": river, "river_version_from": rFrom, "river_version_to": rTo}
		for k, v := range want {
			if got, _ := json.Marshal(line[k]); string(got) != mustJSON(t, v) {
				t.Errorf("summary line's %s = %s, want %s (line %v)", k, got, mustJSON(t, v), line)
			}
		}
	}

	fresh := pgtest.NewEmpty(t)
	lines := up(fresh, slog.LevelInfo)
	if len(lines) != 1 {
		t.Fatalf("at info, %d lines, want the one summary line:\n%v", len(lines), lines)
	}
	summary(lines[0], len(files)+len(riverAll), len(files), 0, workerLast, len(riverAll), 0, riverLast)
	again := up(fresh, slog.LevelInfo)
	if len(again) != 1 {
		t.Fatalf("nothing to apply: %d lines, want the one summary line:\n%v", len(again), again)
	}
	summary(again[0], 0, 0, workerLast, workerLast, 0, riverLast, riverLast)

	debug := up(pgtest.NewEmpty(t), slog.LevelDebug)
	per := map[string]int{}
	for _, l := range debug {
		if l["level"] == "DEBUG" {
			per[l["msg"].(string)]++
		}
	}
	if per["migration applied"] != len(files) || per["river migration applied"] != len(riverAll) {
		t.Errorf("at debug, per-migration lines %v, want %d worker and %d River", per, len(files), len(riverAll))
	}
	summary(debug[len(debug)-1], len(files)+len(riverAll), len(files), 0, workerLast, len(riverAll), 0, riverLast)
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
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
