// Package outboxtest helps tests see what the relay did to the outbox. It
// needs only the schema, so the outbox package's own tests can use it too.
package outboxtest

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// RecordPublishes makes the database record every publish from now on in
// the table test_publish. A published event keeps no delivery row
// (migrations/00140_outbox_storage_v2.sql), so its row is caught as it is
// deleted: its id, aggregate, status, attempts, claim and last error, the
// deleting transaction (xact) and the database clock (at). Only a publish
// deletes a row that is not DEAD (a purge deletes DEAD ones).
func RecordPublishes(tb testing.TB, pool *pgxpool.Pool) {
	tb.Helper()
	if _, err := pool.Exec(tb.Context(), `
CREATE TABLE test_publish (
    id             bigint      NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    status         text        NOT NULL,
    attempts       integer     NOT NULL,
    claimed_by     text,
    last_error     text,
    xact           bigint      NOT NULL,
    at             timestamptz NOT NULL
);
CREATE FUNCTION test_record_publish() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_publish
    VALUES (OLD.id, OLD.aggregate_type, OLD.aggregate_id, OLD.status, OLD.attempts, OLD.claimed_by, OLD.last_error,
            txid_current(), clock_timestamp());
    RETURN NULL;
END $$;
CREATE TRIGGER test_record_publish AFTER DELETE ON outbox_delivery
    FOR EACH ROW WHEN (OLD.dead_at IS NULL) EXECUTE FUNCTION test_record_publish();`); err != nil {
		tb.Fatal(err)
	}
}
