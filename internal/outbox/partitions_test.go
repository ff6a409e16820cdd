package outbox

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
	"github.com/worker-dev/worker/migrations"
)

// freshPartitions drops the partitions the migration made (whole UTC days),
// so a test can lay out its own, seconds long.
func freshPartitions(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	names := partitionNames(t, pool)
	for _, n := range names {
		exec(t, pool, "DROP TABLE "+pgx.Identifier{n}.Sanitize())
	}
	exec(t, pool, "DELETE FROM outbox_partition")
}

// secondPartitions returns a database whose outbox_event has one-second
// partitions, ahead of them as many as ahead says, and their keeper.
func secondPartitions(t *testing.T, ahead int, retention time.Duration) (*pgtest.DB, *Partitions) {
	t.Helper()
	db := pgtest.New(t)
	freshPartitions(t, db.Pool)
	p := &Partitions{Pool: db.Pool, Interval: time.Second, Ahead: ahead, Retention: retention}
	if _, _, err := p.Maintain(context.Background()); err != nil {
		t.Fatal(err)
	}
	return db, p
}

// waitEnded waits until the database clock has passed the end of the
// partition name.
func waitEnded(t *testing.T, pool *pgxpool.Pool, name string) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, "partition "+name+" to end", func() bool {
		var ended bool
		return pool.QueryRow(context.Background(), `SELECT hi <= now() FROM outbox_partition WHERE name = $1`, name).Scan(&ended) == nil && ended
	})
}

// partitionNames lists the attached partitions of outbox_event, oldest
// first, checking that the catalog table agrees.
func partitionNames(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'outbox_event'::regclass ORDER BY c.relname`)
	if err != nil {
		t.Fatal(err)
	}
	attached, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var catalog []string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM outbox_partition`).Scan(&catalog); err != nil {
		t.Fatal(err)
	}
	if len(catalog) != len(attached) {
		t.Fatalf("attached partitions %v, catalog %v", attached, catalog)
	}
	return attached
}

// TestPartitionsCreateAhead: the keeper covers now to Ahead intervals
// ahead, aligned on the interval, continues from the last partition, and
// a second run creates nothing.
func TestPartitionsCreateAhead(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	// The migration made today's and tomorrow's UTC days.
	if n := partitionNames(t, db.Pool); len(n) != 2 {
		t.Fatalf("after the migration: %v, want today and tomorrow", n)
	}
	p := &Partitions{Pool: db.Pool, Interval: 24 * time.Hour, Ahead: 4, Retention: 7 * 24 * time.Hour}
	created, dropped, err := p.Maintain(ctx)
	if err != nil || len(dropped) != 0 {
		t.Fatalf("Maintain: created %v dropped %v: %v", created, dropped, err)
	}
	var covered time.Duration
	var midnight bool
	if err := db.Pool.QueryRow(ctx, `SELECT (extract(epoch FROM max(hi) - now()) * 1e9)::bigint,
		bool_and(lo = date_trunc('day', lo AT TIME ZONE 'UTC') AT TIME ZONE 'UTC') FROM outbox_partition`).Scan(&covered, &midnight); err != nil {
		t.Fatal(err)
	}
	if covered < 4*24*time.Hour || covered > 5*24*time.Hour || !midnight {
		t.Errorf("partitions cover %s past now (want 4 to 5 days), all from midnight UTC: %v", covered, midnight)
	}
	if again, _, err := p.Maintain(ctx); err != nil || len(again) != 0 {
		t.Errorf("second run created %v (%v), want nothing", again, err)
	}
}

// TestPartitionsNothingFailsAtTheBoundary: with one-second partitions, two
// ahead, and the keeper running as it would in the worker, producers insert
// without a pause across several partition boundaries and none of their
// inserts fails; each row lands in the partition of its created_at.
func TestPartitionsNothingFailsAtTheBoundary(t *testing.T) {
	t.Parallel()
	db, p := secondPartitions(t, 2, time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			if err := p.Run(ctx); err != nil && ctx.Err() == nil {
				t.Errorf("keeper: %v", err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(p.Interval / 4): // the worker's delay for this interval
			}
		}
	})
	var inserted, failed atomic.Int64
	for range 2 {
		wg.Go(func() {
			for ctx.Err() == nil {
				_, err := db.Pool.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'a', 'x', '{}')`)
				switch {
				case err == nil:
					inserted.Add(1)
				case ctx.Err() == nil:
					failed.Add(1)
					t.Errorf("insert: %v", err)
				}
			}
		})
	}
	var start time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT now()").Scan(&start); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "inserts across four partition boundaries", func() bool {
		var spread int
		err := db.Pool.QueryRow(ctx, `SELECT count(DISTINCT tableoid) FROM outbox_event`).Scan(&spread)
		return err == nil && spread >= 5
	})
	cancel()
	wg.Wait()
	if failed.Load() > 0 || inserted.Load() == 0 {
		t.Fatalf("%d inserts, %d failed", inserted.Load(), failed.Load())
	}
	var misplaced int
	if err := db.Pool.QueryRow(context.Background(), `
SELECT count(*) FROM outbox_event e JOIN outbox_partition p ON p.name = e.tableoid::regclass::text
WHERE NOT (e.created_at >= p.lo AND e.created_at < p.hi)`).Scan(&misplaced); err != nil || misplaced != 0 {
		t.Errorf("%d rows outside their partition's bounds (%v)", misplaced, err)
	}
}

// TestPartitionsDropOnlyWhatIsDone: past retention, a partition whose
// events are all published is dropped; one with an event still to publish,
// or a DEAD one, is kept until that event is published or purged. Newer
// partitions are kept whatever they hold.
func TestPartitionsDropOnlyWhatIsDone(t *testing.T) {
	t.Parallel()
	// Three one-second partitions, one event each, written a second apart.
	db, p := secondPartitions(t, 6, time.Hour)
	ctx := context.Background()
	var ids []string
	var parts []string
	for i := range 3 {
		var lo time.Time
		if err := db.Pool.QueryRow(ctx, `SELECT lo FROM outbox_partition WHERE lo > now() ORDER BY lo LIMIT 1`).Scan(&lo); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 5*time.Second, "the next partition's second", func() bool {
			var now time.Time
			return db.Pool.QueryRow(ctx, "SELECT now()").Scan(&now) == nil && !now.Before(lo)
		})
		ids = append(ids, appendEvent(t, db.Pool, "agg", []string{"published", "pending", "dead"}[i]))
		var part string
		if err := db.Pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM outbox_event WHERE event_id = $1`, ids[i]).Scan(&part); err != nil {
			t.Fatal(err)
		}
		parts = append(parts, part)
	}
	published := func(id string) {
		exec(t, db.Pool, `DELETE FROM outbox_delivery WHERE id = (SELECT id FROM outbox_event WHERE event_id = $1)`, id)
	}
	published(ids[0])
	markDead(t, db.Pool, ids[2])

	// Within retention nothing goes, done or not.
	if _, dropped, err := p.Maintain(ctx); err != nil || len(dropped) != 0 {
		t.Fatalf("within retention: dropped %v (%v)", dropped, err)
	}
	p.Retention = 0 // every partition that has ended is past retention
	waitEnded(t, db.Pool, parts[2])
	_, dropped, err := p.Maintain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(dropped, parts[0]) || slices.Contains(dropped, parts[1]) || slices.Contains(dropped, parts[2]) {
		t.Fatalf("dropped %v; want %s (published) and not %s (pending) nor %s (DEAD)", dropped, parts[0], parts[1], parts[2])
	}
	for _, n := range partitionNames(t, db.Pool) {
		if n == parts[0] {
			t.Fatalf("%s still attached", n)
		}
	}
	if st := statusOf(t, db.Pool, ids[1]); st != StatusPending {
		t.Errorf("the pending event reads %s", st)
	}

	published(ids[1])
	if n, err := PurgeDead(ctx, db.Pool, ids[2], "test", nil); err != nil || n != 1 {
		t.Fatalf("purge: %d %v", n, err)
	}
	if st := statusOf(t, db.Pool, ids[2]); st != "PURGED" {
		t.Errorf("a purged event reads %s, want PURGED: it was never published", st)
	}
	if _, dropped, err = p.Maintain(ctx); err != nil || !slices.Contains(dropped, parts[1]) || !slices.Contains(dropped, parts[2]) {
		t.Fatalf("after the publish and the purge: dropped %v (%v), want %s and %s", dropped, err, parts[1], parts[2])
	}
	var purgeRecords int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_purged`).Scan(&purgeRecords); err != nil || purgeRecords != 0 {
		t.Errorf("%d purge records left after their partition was dropped (%v)", purgeRecords, err)
	}
	var eventIDs int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_id WHERE event_id = ANY($1::uuid[])`, ids).Scan(&eventIDs); err != nil || eventIDs != 0 {
		t.Errorf("%d event_ids left after their partitions were dropped (%v)", eventIDs, err)
	}
}

// TestPartitionsFinishAnInterruptedDetach: a detach cancelled halfway (its
// wait for older snapshots timed out) leaves the partition pending detach;
// the next run finishes it and drops the partition.
func TestPartitionsFinishAnInterruptedDetach(t *testing.T) {
	t.Parallel()
	db, p := secondPartitions(t, 2, 0)
	ctx := context.Background()
	var victim string
	if err := db.Pool.QueryRow(ctx, `SELECT name FROM outbox_partition ORDER BY lo LIMIT 1`).Scan(&victim); err != nil {
		t.Fatal(err)
	}
	// A transaction that has read outbox_event holds back the second phase
	// of a concurrent detach, which then times out.
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, "SELECT count(*) FROM outbox_event"); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(ctx, "SET statement_timeout = '500ms'")
	if err == nil {
		_, err = conn.Exec(ctx, "ALTER TABLE outbox_event DETACH PARTITION "+pgx.Identifier{victim}.Sanitize()+" CONCURRENTLY")
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "57014" { // query_canceled
		t.Fatalf("the detach was not interrupted: %v", err)
	}
	_, _ = conn.Exec(ctx, "RESET statement_timeout")
	conn.Release()
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var pending bool
	if err := db.Pool.QueryRow(ctx, `SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = $1::regclass`, victim).Scan(&pending); err != nil || !pending {
		t.Fatalf("pending detach: %v (%v)", pending, err)
	}
	waitEnded(t, db.Pool, victim)
	_, dropped, err := p.Maintain(ctx)
	if err != nil || !slices.Contains(dropped, victim) {
		t.Fatalf("dropped %v (%v), want %s", dropped, err, victim)
	}
	var exists bool
	if err := db.Pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, victim).Scan(&exists); err != nil || exists {
		t.Errorf("%s still exists (%v)", victim, err)
	}
}

// TestEnvelopeIsImmutable: an envelope cannot be updated or deleted, by
// anyone; its delivery row can.
func TestEnvelopeIsImmutable(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	id := appendEvent(t, db.Pool, "a", "x")
	for _, q := range []string{
		`UPDATE outbox_event SET payload = '{"changed": true}' WHERE event_id = $1`,
		`UPDATE outbox_event SET aggregate_id = 'b' WHERE event_id = $1`,
		`DELETE FROM outbox_event WHERE event_id = $1`,
	} {
		_, err := db.Pool.Exec(context.Background(), q, id)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23001" {
			t.Errorf("%s: %v, want a refusal (23001)", q, err)
		}
	}
	setDelivery(t, db.Pool, id, "status = 'FAILED', attempts = 1")
	if st := statusOf(t, db.Pool, id); st != StatusFailed {
		t.Errorf("delivery row not updatable: %s", st)
	}
}

// TestDuplicateEventIDAcrossPartitions: an event_id given twice is refused
// under the V1 constraint's name, also when the first one is in an older
// partition than the one the second would go to.
func TestDuplicateEventIDAcrossPartitions(t *testing.T) {
	t.Parallel()
	db, _ := secondPartitions(t, 4, time.Hour)
	ctx := context.Background()
	const id = "6f1c1a3e-3f7b-4c55-9d0e-0d4a8c2b7e11"
	insert := func() error {
		_, err := db.Pool.Exec(ctx, `INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
			VALUES ($1, 'order', 'a', 'x', '{}')`, id)
		return err
	}
	if err := insert(); err != nil {
		t.Fatal(err)
	}
	var first string
	if err := db.Pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM outbox_event WHERE event_id = $1`, id).Scan(&first); err != nil {
		t.Fatal(err)
	}
	waitEnded(t, db.Pool, first)
	err := insert()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || pgErr.ConstraintName != "outbox_event_event_id_key" {
		t.Fatalf("duplicate in a later partition: %v, want 23505 on outbox_event_event_id_key", err)
	}
}

// TestDuplicateEventIDRacingInserts: of two transactions inserting the same
// event_id at once, the second waits for the first and is refused once it
// commits, at any isolation level: the refusal is a unique index's, which
// sees past a snapshot.
func TestDuplicateEventIDRacingInserts(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := context.Background()
			const id = "1d7e0c2a-5b8f-4d0e-9a61-3c2f4b7d9e20"
			const insert = `INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
				VALUES ($1, 'order', $2, 'x', '{}')`
			first, err := db.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = first.Rollback(ctx) }()
			if _, err := first.Exec(ctx, insert, id, "a"); err != nil {
				t.Fatal(err)
			}
			second := make(chan error, 1)
			go func() {
				// Another aggregate: only the event_id is shared. The
				// snapshot is taken before the first commits.
				second <- pgx.BeginTxFunc(ctx, db.Pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, insert, id, "b")
					return err
				})
			}()
			testkit.Eventually(t, 10*time.Second, "the second insert waiting for the first", func() bool {
				var waiting bool
				err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO outbox_event%')`).Scan(&waiting)
				return err == nil && waiting
			})
			if err := first.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			var pgErr *pgconn.PgError
			if err := <-second; !errors.As(err, &pgErr) || pgErr.Code != "23505" || pgErr.ConstraintName != "outbox_event_event_id_key" {
				t.Fatalf("the racing duplicate: %v, want 23505 on outbox_event_event_id_key", err)
			}
			var n int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE event_id = $1`, id).Scan(&n); err != nil || n != 1 {
				t.Fatalf("%d events hold the event_id (%v), want 1", n, err)
			}
		})
	}
}

// TestManyGivenEventIDsInOneTransaction: a producer transaction may give
// any number of event_ids, as V1 allowed; no lock is taken per event_id, so
// the server's lock table does not run out.
func TestManyGivenEventIDsInOneTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	const n = 20000
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
			SELECT gen_random_uuid(), 'order', 'a', 'x', '{}' FROM generate_series(1, $1)`, n)
		return err
	})
	if err != nil {
		t.Fatalf("%d given event_ids in one transaction: %v", n, err)
	}
	var ids int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_id`).Scan(&ids); err != nil || ids != n {
		t.Fatalf("outbox_event_id holds %d rows (%v), want %d", ids, err, n)
	}
}

// TestPartitionsLayAnEmptyTableOnTheInterval: the migration made two
// day-long partitions. On a table that holds no event, the keeper with
// partitions of an hour, three ahead, replaces them by hourly ones from now
// on, and the first event lands in an hour-long partition. On a table that
// holds one, the day-long partitions stay.
func TestPartitionsLayAnEmptyTableOnTheInterval(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	hourly := func(t *testing.T) (*pgtest.DB, *Partitions) {
		t.Helper()
		db := pgtest.New(t)
		if n := partitionNames(t, db.Pool); len(n) != 2 {
			t.Fatalf("after the migration: %v, want today and tomorrow", n)
		}
		return db, &Partitions{Pool: db.Pool, Interval: time.Hour, Ahead: 3, Retention: 24 * time.Hour}
	}
	lengths := func(t *testing.T, db *pgtest.DB) (hours []float64, reach time.Duration) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT array_agg(extract(epoch FROM hi - lo) / 3600 ORDER BY lo),
			(extract(epoch FROM max(hi) - now()) * 1e9)::bigint FROM outbox_partition`).Scan(&hours, &reach); err != nil {
			t.Fatal(err)
		}
		return hours, reach
	}

	t.Run("empty", func(t *testing.T) {
		t.Parallel()
		db, p := hourly(t)
		created, _, err := p.Maintain(ctx)
		if err != nil {
			t.Fatal(err)
		}
		hours, reach := lengths(t, db)
		for _, h := range hours {
			if h != 1 {
				t.Fatalf("partitions of %v hours after the keeper ran, want all 1", hours)
			}
		}
		if reach < 3*time.Hour || reach > 4*time.Hour || len(created) != len(hours) {
			t.Errorf("partitions reach %s past now (want 3 to 4 hours); created %v, attached %d", reach, created, len(hours))
		}
		var length time.Duration
		if err := db.Pool.QueryRow(ctx, `WITH e AS (
				INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
				VALUES ('order', '1', 'order.created', '{}') RETURNING created_at)
			SELECT (extract(epoch FROM p.hi - p.lo) * 1e9)::bigint FROM e JOIN outbox_partition p ON e.created_at >= p.lo AND e.created_at < p.hi`).
			Scan(&length); err != nil {
			t.Fatal(err)
		}
		if length != time.Hour {
			t.Errorf("the first event landed in a partition %s long, want 1h", length)
		}
		if again, _, err := p.Maintain(ctx); err != nil || len(again) != 0 {
			t.Errorf("a second run created %v (%v), want nothing", again, err)
		}
	})

	t.Run("holding an event", func(t *testing.T) {
		t.Parallel()
		db, p := hourly(t)
		appendEvent(t, db.Pool, "kept", "e1")
		before := partitionNames(t, db.Pool)
		if _, _, err := p.Maintain(ctx); err != nil {
			t.Fatal(err)
		}
		if after := partitionNames(t, db.Pool); !slices.Equal(after[:min(len(after), 2)], before) {
			t.Errorf("partitions %v after the keeper ran on a table holding an event, want %v kept", after, before)
		}
	})
}

// TestInsertWithoutAPartitionNamesTheKeeper: with no partition for now,
// an insert is refused with SQLSTATE 23514 under the constraint
// outbox_event_no_partition_ahead, and the message and hint say which job
// creates partitions and where the runbook is; not PostgreSQL's bare "no
// partition of relation". Append returns that error as it is.
func TestInsertWithoutAPartitionNamesTheKeeper(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	freshPartitions(t, db.Pool)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('order', '1', 'order.created', '{}')`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		t.Fatalf("insert without a partition: %v, want a PostgreSQL error", err)
	}
	t.Logf("%s (SQLSTATE %s, constraint %s); HINT: %s", pgErr.Message, pgErr.Code, pgErr.ConstraintName, pgErr.Hint)
	if pgErr.Code != "23514" || pgErr.ConstraintName != "outbox_event_no_partition_ahead" || pgErr.TableName != "outbox_event" {
		t.Errorf("SQLSTATE %s, constraint %q, table %q; want 23514, outbox_event_no_partition_ahead, outbox_event",
			pgErr.Code, pgErr.ConstraintName, pgErr.TableName)
	}
	if !strings.HasPrefix(pgErr.Message, "no outbox_event partition covers ") || !strings.Contains(pgErr.Message, "outbox-partitions job") ||
		!strings.Contains(pgErr.Hint, "docs/runbooks/WorkerOutboxPartitionsRunningOut.md") ||
		!strings.Contains(pgErr.Detail, "WorkerOutboxPartitionsRunningOut") {
		t.Errorf("message %q, detail %q, hint %q: want the job, the alert and the runbook named", pgErr.Message, pgErr.Detail, pgErr.Hint)
	}

	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = Append(ctx, tx, NewEvent{AggregateType: "order", AggregateID: "1", EventType: "order.created", Payload: []byte(`{}`)})
	var rule *RuleError
	if !errors.As(err, &pgErr) || pgErr.ConstraintName != "outbox_event_no_partition_ahead" || errors.As(err, &rule) {
		t.Errorf("Append without a partition: %v; want the PostgreSQL error, not a rule's", err)
	}
}

// TestEventIDMigrationCarriesTheIDs: migration 00160 on a database that
// holds events, V1 history among them, copies every V2 event's event_id,
// so one given before the upgrade is refused after it; the V1 table keeps
// its history under a renamed constraint.
func TestEventIDMigrationCarriesTheIDs(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer sqlDB.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS, goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	const v1, v2 = "0b6c3c5e-8f0e-4b7a-9d2c-1e5f6a7b8c90", "3a2b1c0d-9e8f-4a7b-8c6d-5e4f3a2b1c0d"
	const insert = `INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
		VALUES ($1, 'order', 'a', 'x', '{}')`
	if _, err := p.UpTo(ctx, 130); err != nil {
		t.Fatal(err)
	}
	exec(t, db.Pool, insert, v1)
	exec(t, db.Pool, `UPDATE outbox_event SET status = 'PUBLISHED', published_at = now()`)
	if _, err := p.UpTo(ctx, 150); err != nil {
		t.Fatal(err)
	}
	exec(t, db.Pool, insert, v2)
	exec(t, db.Pool, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', 'b', 'x', '{}' FROM generate_series(1, 100)`)
	if err := migrate.Up(ctx, db.Pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}

	var events, ids int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_event), (SELECT count(*) FROM outbox_event_id)`).Scan(&events, &ids); err != nil {
		t.Fatal(err)
	}
	if events != 101 || ids != events {
		t.Fatalf("%d events, %d event_ids carried; want 101 of each", events, ids)
	}
	_, err = db.Pool.Exec(ctx, insert, v2)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || pgErr.ConstraintName != "outbox_event_event_id_key" {
		t.Fatalf("an event_id given before the upgrade, again after it: %v, want 23505 on outbox_event_event_id_key", err)
	}
	var constraint string
	if err := db.Pool.QueryRow(ctx, `SELECT conname FROM pg_constraint
		WHERE conrelid = 'outbox_event_v1'::regclass AND contype = 'u'`).Scan(&constraint); err != nil || constraint != "outbox_event_v1_event_id_key" {
		t.Fatalf("the V1 history's unique constraint is %q (%v), want outbox_event_v1_event_id_key", constraint, err)
	}
}
