-- +goose Up
-- event_id uniqueness without a probe per partition (docs/outbox.md,
-- "Storage"). A unique index on the partitioned outbox_event would have to
-- include the partition key, so 00140 made the insert trigger lock a given
-- event_id and look it up in every partition: an index probe each, and one
-- advisory lock per event held to commit, which a transaction giving a few
-- thousand event_ids ran out of (max_locks_per_transaction).
--
-- Instead every event's id goes into one narrow, unpartitioned table whose
-- primary key carries the V1 constraint's name, so a duplicate is refused
-- by PostgreSQL itself, as V1 refused it: SQLSTATE 23505, constraint
-- outbox_event_event_id_key, at any isolation level and with no lock of
-- ours. Its rows go with their partition at retention (internal/outbox,
-- partitions.go), by created_at, which the BRIN index finds cheaply since
-- rows arrive in created_at order.
--
-- The V1 table keeps its history until retention drops it; its constraint
-- is renamed first, since an index's name is unique in the schema.
--
-- Producers wait while the existing event_ids are copied, one narrow row
-- each (tens of thousands a second): the table lock keeps an insert from
-- slipping between the copy and the new trigger. Relays only read
-- outbox_event and carry on.
SET LOCAL lock_timeout = '2s';
LOCK TABLE outbox_event IN SHARE ROW EXCLUSIVE MODE;

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = to_regclass('outbox_event_v1') AND conname = 'outbox_event_event_id_key') THEN
        ALTER TABLE outbox_event_v1 RENAME CONSTRAINT outbox_event_event_id_key TO outbox_event_v1_event_id_key;
    END IF;
END
$$;
-- +goose StatementEnd

CREATE TABLE outbox_event_id (
    event_id   uuid        NOT NULL,
    created_at timestamptz NOT NULL,
    CONSTRAINT outbox_event_event_id_key PRIMARY KEY (event_id)
);
CREATE INDEX outbox_event_id_created_at_idx ON outbox_event_id USING brin (created_at);

INSERT INTO outbox_event_id (event_id, created_at)
SELECT event_id, created_at FROM outbox_event;

-- The append as in 00140, with the probe and its lock replaced by the
-- insert into outbox_event_id. The per-aggregate lock and the id drawn
-- after it keep each aggregate's commit order (read 00030_outbox.sql).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_event_append() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7304564, hashtext(NEW.aggregate_type || ':' || NEW.aggregate_id));
    NEW.event_id := coalesce(NEW.event_id, gen_random_uuid());
    NEW.id := nextval('outbox_event_id_seq');
    NEW.created_at := now();
    INSERT INTO outbox_event_id (event_id, created_at) VALUES (NEW.event_id, NEW.created_at);
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_event_append() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7304564, hashtext(NEW.aggregate_type || ':' || NEW.aggregate_id));
    IF NEW.event_id IS NULL THEN
        NEW.event_id := gen_random_uuid();
    ELSE
        PERFORM pg_advisory_xact_lock(7304566, hashtext(NEW.event_id::text));
        IF EXISTS (SELECT 1 FROM outbox_event WHERE event_id = NEW.event_id) THEN
            RAISE unique_violation USING
                MESSAGE = 'duplicate key value violates unique constraint "outbox_event_event_id_key"',
                DETAIL = format('Key (event_id)=(%s) already exists.', NEW.event_id),
                CONSTRAINT = 'outbox_event_event_id_key', TABLE = 'outbox_event';
        END IF;
    END IF;
    NEW.id := nextval('outbox_event_id_seq');
    NEW.created_at := now();
    RETURN NEW;
END
$$;
-- +goose StatementEnd
DROP TABLE outbox_event_id;
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = to_regclass('outbox_event_v1') AND conname = 'outbox_event_v1_event_id_key') THEN
        ALTER TABLE outbox_event_v1 RENAME CONSTRAINT outbox_event_v1_event_id_key TO outbox_event_event_id_key;
    END IF;
END
$$;
-- +goose StatementEnd
