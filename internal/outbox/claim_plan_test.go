package outbox

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// A relay idle on a nearly empty table plans its claim statements for it
// (a sequential scan and a sort); a backlog that comes later must be
// claimed with plans made for it, not read whole for every batch. The
// relay's one connection is looked at afterwards: its window statement's
// generic plan walks the live index.
func TestClaimReplansForABacklog(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	exec(t, db.Pool, "VACUUM ANALYZE outbox_delivery")
	pool := db.NewPool(t, 1) // the relay's claims all run on this connection
	cfg := testConfig()
	cfg.MetricsInterval = time.Hour // keeps the gauges off the connection
	rec := &recorder{}
	r, err := NewRelay(pool, rec, cfg, "test-relay", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(ctx); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := r.Shutdown(sctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	}
	defer stop()

	appendEvent(t, db.Pool, "first", "e")
	testkit.Eventually(t, 10*time.Second, "the first event published", func() bool { return len(rec.delivered()) == 1 })
	const backlog = 5_000
	exec(t, db.Pool, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', (g % 1000)::text, 'e', '{}' FROM generate_series(1, $1::int) g`, backlog)
	testkit.Eventually(t, 2*time.Minute, "the backlog published", func() bool { return len(rec.delivered()) == backlog+1 })
	stop()

	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var name string
	if err := conn.QueryRow(ctx, "SELECT name FROM pg_prepared_statements WHERE statement = $1", windowSQL).Scan(&name); err != nil {
		t.Fatalf("the relay's window statement on its connection: %v", err)
	}
	var plan strings.Builder
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, "EXPLAIN EXECUTE "+pgx.Identifier{name}.Sanitize()+"(800)", pgx.QueryExecModeSimpleProtocol)
		if err != nil {
			return err
		}
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				return err
			}
			plan.WriteString(line + "\n")
		}
		return rows.Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(plan.String(), "outbox_delivery_live_idx") || strings.Contains(plan.String(), "Seq Scan") {
		t.Fatalf("the window's plan after a backlog reads the whole table:\n%s", plan.String())
	}
}
