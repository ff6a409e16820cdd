-- +goose Up
-- Outbox storage V2 (docs/outbox.md, "Storage"). What a producer writes
-- and what the relay tracks live apart:
--
--   outbox_event     the envelope: what the producer inserted, never
--                    changed afterwards, partitioned by created_at (one
--                    partition a day by default). Retention drops whole
--                    partitions: no DELETE, no bloat, no vacuum debt.
--   outbox_delivery  one narrow row per event still to publish, or DEAD.
--                    The relay locks it to claim the event and deletes it
--                    when the event is published. Its indexes cover neither
--                    status nor attempts nor next_attempt_at, so a retry,
--                    a detach or a completion is a HOT update.
--
-- The producer contract does not change: the same INSERT INTO outbox_event
-- with the same columns, defaults and named rules.
--
-- This migration is the cutover from V1, online and in one transaction. It
-- locks the V1 table (producers and old relays wait, a few milliseconds
-- for an empty backlog), renames it outbox_event_v1, creates V2 under the
-- old name and carries every unfinished and DEAD V1 event over with its id,
-- state and attempts. Killed halfway, it rolls back whole and the next
-- `worker migrate` starts again; once applied, goose never runs it again.
-- lock_timeout bounds how long producers queue behind the lock when an old
-- relay or a long transaction holds the table; `worker migrate` retries.
SET LOCAL lock_timeout = '2s';
LOCK TABLE outbox_event IN ACCESS EXCLUSIVE MODE;

ALTER TABLE outbox_event RENAME TO outbox_event_v1;
-- The id sequence outlives the V1 table, which goes once its history is
-- past retention.
ALTER SEQUENCE outbox_event_id_seq OWNED BY NONE;

-- The publication control row: which storage takes appends, since when.
-- The cutover above is ordered against appends by the table lock: an
-- append in progress holds the V1 table until it commits, and the rename
-- waits for it, so no append overtakes the switch.
CREATE TABLE outbox_publication (
    singleton   boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    storage     text        NOT NULL CHECK (storage = 'v2'),
    cut_over_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox_publication (storage) VALUES ('v2');

-- A writer still aiming at the V1 table (a session that resolved the name
-- before the rename) fails loudly instead of writing where nobody reads.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox_event_v1 takes no writes: the outbox moved to storage V2; insert into outbox_event'
        USING ERRCODE = 'object_not_in_prerequisite_state';
END
$$;
-- +goose StatementEnd

CREATE TABLE outbox_event (
    id              bigint      NOT NULL,
    -- No default: the insert trigger draws one when the producer gave none,
    -- and checks uniqueness only when the producer did.
    event_id        uuid        NOT NULL,
    aggregate_type  text        COLLATE "C" NOT NULL,
    aggregate_id    text        COLLATE "C" NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    occurred_at     timestamptz NOT NULL DEFAULT now(),
    -- The partition key. A row is routed before any trigger runs, so this
    -- is the column default, the start of the producer's transaction.
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_event_v2_pkey PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);

-- The duplicate probe of the insert trigger.
CREATE INDEX outbox_event_v2_event_id_idx ON outbox_event (event_id);

-- The partitions, one row each: the partition keeper (internal/outbox,
-- partitions.go) creates them ahead of time and drops them after
-- retention.
CREATE TABLE outbox_partition (
    name text        PRIMARY KEY,
    lo   timestamptz NOT NULL UNIQUE,
    hi   timestamptz NOT NULL,
    CHECK (hi > lo)
);

-- outbox_event_add_partition creates the partition [lo, hi). It builds the
-- table apart and attaches it, which locks outbox_event only in SHARE
-- UPDATE EXCLUSIVE mode: producers and relays keep going meanwhile
-- (CREATE TABLE ... PARTITION OF would wait for every open transaction on
-- the table, and make new ones wait behind it). The attached table takes
-- the parent's indexes, constraints and triggers.
-- +goose StatementBegin
CREATE FUNCTION outbox_event_add_partition(lo timestamptz, hi timestamptz) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    name text := 'outbox_event_' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
BEGIN
    EXECUTE format('CREATE TABLE %I (LIKE outbox_event INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', name);
    EXECUTE format('ALTER TABLE outbox_event ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', name, lo, hi);
    INSERT INTO outbox_partition (name, lo, hi) VALUES (name, lo, hi);
    RETURN name;
END
$$;
-- +goose StatementEnd

-- Today's and tomorrow's partitions (UTC days); the keeper adds the rest.
SELECT outbox_event_add_partition(d, d + interval '1 day')
FROM generate_series(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC',
                     date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '1 day',
                     interval '1 day') AS d;

CREATE TABLE outbox_delivery (
    id              bigint      PRIMARY KEY,
    created_at      timestamptz NOT NULL, -- the envelope's, to find its partition
    aggregate_type  text        COLLATE "C" NOT NULL,
    aggregate_id    text        COLLATE "C" NOT NULL,
    -- PENDING, IN_FLIGHT or FAILED as in V1; DEAD with dead_at set.
    -- PUBLISHED is not a state here: the row is deleted.
    status          text        NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'IN_FLIGHT', 'FAILED', 'DEAD')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    claimed_by      text,
    last_error      text,
    -- The indexes tell live rows from DEAD ones by dead_at, not status, so
    -- that status changes among PENDING, IN_FLIGHT and FAILED stay HOT.
    dead_at         timestamptz,
    CONSTRAINT outbox_delivery_dead_at CHECK ((status = 'DEAD') = (dead_at IS NOT NULL))
) WITH (fillfactor = 90, autovacuum_vacuum_scale_factor = 0.02);
-- fillfactor leaves room on each page for HOT updates. The table is a
-- queue: rows are deleted as they are published, so autovacuum runs on a
-- small fraction of dead rows rather than the default fifth of the table.

-- Claim scan: the oldest live rows first.
CREATE INDEX outbox_delivery_live_idx ON outbox_delivery (id) WHERE dead_at IS NULL;
-- Ordering gate and the per-aggregate run that follows a claimed head.
CREATE INDEX outbox_delivery_aggregate_idx ON outbox_delivery (aggregate_type, aggregate_id, id)
    WHERE dead_at IS NULL;
-- Gate with block_on_dead, and the dead-letter listing.
CREATE INDEX outbox_delivery_dead_idx ON outbox_delivery (aggregate_type, aggregate_id, id)
    WHERE dead_at IS NOT NULL;

-- Purged events: DEAD events an operator gave up on (`worker outbox dead
-- purge`). Their delivery rows are gone, so their partition can be dropped;
-- this row tells them from published ones until it is, and goes with it.
CREATE TABLE outbox_purged (
    id         bigint      PRIMARY KEY,
    created_at timestamptz NOT NULL,
    purged_at  timestamptz NOT NULL DEFAULT now(),
    last_error text
);

-- Carry the V1 events still to publish, and the DEAD ones, with their ids
-- and state. They land in today's partition, so they keep it until they
-- are done. No trigger exists yet on the new table: the carried rows keep
-- their ids, and their delivery rows are written here.
INSERT INTO outbox_event (id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at)
SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at
FROM outbox_event_v1 WHERE status <> 'PUBLISHED';

INSERT INTO outbox_delivery (id, created_at, aggregate_type, aggregate_id, status, attempts, next_attempt_at,
                             claimed_by, last_error, dead_at)
SELECT id, now(), aggregate_type, aggregate_id, status, attempts, next_attempt_at, claimed_by, last_error,
       CASE WHEN status = 'DEAD' THEN next_attempt_at END
FROM outbox_event_v1 WHERE status <> 'PUBLISHED';

-- A V1 table that held nothing but published history is dropped with its
-- history once that is past retention (the keeper); an empty one now.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox_event_v1) THEN
        DROP TABLE outbox_event_v1;
    END IF;
END
$$;
-- +goose StatementEnd

-- The producer rules of 00040 and 00082, with the same names, refusing the
-- same rows. An envelope is never updated, so the V1 exemption for
-- attempted rows is gone. NOT VALID: the carried rows were accepted by V1
-- (a row from before the rules may break one); every new row is checked.
-- outbox_event_headers_object held for every V1 row, so it is validated.
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    ADD CONSTRAINT outbox_event_aggregate_type_not_empty CHECK (aggregate_type <> '') NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_id_not_empty CHECK (aggregate_id <> '') NOT VALID,
    ADD CONSTRAINT outbox_event_event_type_not_empty CHECK (event_type <> '') NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_type_length CHECK (octet_length(aggregate_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_id_length CHECK (octet_length(aggregate_id) <= 512) NOT VALID,
    ADD CONSTRAINT outbox_event_event_type_length CHECK (octet_length(event_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_type_no_control
        CHECK (aggregate_type !~ '[\u0001-\u001f\u007f-\u009f]') NOT VALID,
    ADD CONSTRAINT outbox_event_event_type_no_control
        CHECK (event_type !~ '[\u0001-\u001f\u007f-\u009f]') NOT VALID,
    ADD CONSTRAINT outbox_event_occurred_at_range
        CHECK (occurred_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00') NOT VALID,
    ADD CONSTRAINT outbox_event_headers_strings
        CHECK (NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')) NOT VALID,
    ADD CONSTRAINT outbox_event_headers_size CHECK (octet_length(headers::text) <= 16384) NOT VALID,
    ADD CONSTRAINT outbox_event_occurred_at_not_zero
        CHECK (occurred_at <> '0001-01-01 00:00:00+00') NOT VALID;

-- The append: per-aggregate commit order exactly as in V1 (read
-- 00030_outbox.sql: the aggregate lock, then the id), and event_id
-- uniqueness. A unique index on a partitioned table must include the
-- partition key, so it could not refuse an event_id seen on another day;
-- instead an event_id the producer gave is locked and looked up across
-- partitions (an index probe each), and a duplicate is refused under the
-- V1 constraint's name and SQLSTATE. An event_id left to the default is
-- drawn here and needs no probe.
-- +goose StatementBegin
CREATE FUNCTION outbox_event_append() RETURNS trigger
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

CREATE TRIGGER outbox_event_append BEFORE INSERT ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_event_append();

-- The delivery row, written once the envelope has passed its rules (an
-- AFTER trigger), so a bad row is refused under its rule's name and
-- nothing else.
-- +goose StatementBegin
CREATE FUNCTION outbox_event_deliver() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_delivery (id, created_at, aggregate_type, aggregate_id)
    VALUES (NEW.id, NEW.created_at, NEW.aggregate_type, NEW.aggregate_id);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_event_deliver AFTER INSERT ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_event_deliver();

-- +goose StatementBegin
CREATE FUNCTION outbox_event_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox_event rows are immutable: % refused (retention drops whole partitions)', TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_event_immutable BEFORE UPDATE OR DELETE ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_event_immutable();

-- Wake-up, as in V1: one payload-less notification per inserting statement.
CREATE TRIGGER outbox_event_notify AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();

-- One row per event with its delivery state, for operators and tests:
-- PUBLISHED is an envelope without a delivery row that was not purged. A
-- delivery row without an envelope (a partition dropped by hand) shows
-- with NULL event columns.
CREATE VIEW outbox_event_state AS
SELECT coalesce(e.id, d.id) AS id, e.event_id, coalesce(e.aggregate_type, d.aggregate_type) AS aggregate_type,
       coalesce(e.aggregate_id, d.aggregate_id) AS aggregate_id, e.event_type, e.payload, e.headers,
       e.occurred_at, coalesce(e.created_at, d.created_at) AS created_at,
       CASE WHEN d.id IS NOT NULL THEN d.status WHEN p.id IS NOT NULL THEN 'PURGED' ELSE 'PUBLISHED' END AS status,
       d.attempts, d.next_attempt_at, d.claimed_by, coalesce(d.last_error, p.last_error) AS last_error, d.dead_at
FROM outbox_event e
FULL JOIN outbox_delivery d ON d.id = e.id
LEFT JOIN outbox_purged p ON p.id = e.id;

-- +goose Down
-- +goose StatementBegin
DO $$
BEGIN
    RAISE EXCEPTION 'outbox storage V2 cannot be migrated down: events written since the cutover exist only in V2';
END
$$;
-- +goose StatementEnd
