package migrate_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/pgtest"
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
