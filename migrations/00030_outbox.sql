-- +goose Up
-- Transactional outbox. The producer contract (any language) is:
--
--   INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
--   VALUES ($1, $2, $3, $4::jsonb);
--
-- inside the business transaction. Optional producer columns: event_id
-- (uuid, default gen_random_uuid()), headers (jsonb object, default '{}',
-- e.g. {"traceparent": "..."}) and occurred_at (default now()). Every other
-- column belongs to the relay; the insert trigger resets them.

-- Insertion order. The id column has no default on purpose: the BEFORE
-- INSERT trigger draws the value itself after taking the aggregate lock (see
-- outbox_event_before_insert), and an insert that bypasses the trigger fails
-- instead of producing an out-of-order id.
CREATE SEQUENCE outbox_event_id_seq AS bigint;

CREATE TABLE outbox_event (
    id              bigint      PRIMARY KEY,
    event_id        uuid        NOT NULL DEFAULT gen_random_uuid(),
    -- "C" collation: the ordering gate compares these keys on every claim;
    -- byte order is all it needs and is cheaper than a locale's.
    aggregate_type  text        COLLATE "C" NOT NULL,
    aggregate_id    text        COLLATE "C" NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    occurred_at     timestamptz NOT NULL DEFAULT now(),

    -- Relay state. PENDING -> PUBLISHED, or FAILED (retry at
    -- next_attempt_at) -> ... -> DEAD. next_attempt_at is the single "not
    -- before" instant: the retry time for FAILED and the visibility deadline
    -- for IN_FLIGHT. The relay in internal/outbox claims by holding row locks
    -- inside its transaction (one write per event) and writes IN_FLIGHT only
    -- for a publish still outstanding when its batch commits (detach_after);
    -- an IN_FLIGHT row is reclaimed once its deadline passes.
    status          text        NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'IN_FLIGHT', 'PUBLISHED', 'FAILED', 'DEAD')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    claimed_by      text,
    last_error      text,
    published_at    timestamptz,
    CONSTRAINT outbox_event_event_id_key UNIQUE (event_id),
    CONSTRAINT outbox_event_headers_object CHECK (jsonb_typeof(headers) = 'object')
);

ALTER SEQUENCE outbox_event_id_seq OWNED BY outbox_event.id;

-- Partial indexes cover only unfinished rows, so millions of PUBLISHED or
-- DEAD rows cost the claim nothing.
-- Claim scan: oldest unfinished rows first.
CREATE INDEX outbox_event_unfinished_idx ON outbox_event (id)
    WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT');
-- Ordering gate ("is there an earlier unfinished event of this aggregate?")
-- and the per-aggregate run that follows a claimed head.
CREATE INDEX outbox_event_aggregate_idx ON outbox_event (aggregate_type, aggregate_id, id)
    WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT');
-- Gate with block_on_dead, and the dead-letter listing.
CREATE INDEX outbox_event_dead_idx ON outbox_event (aggregate_type, aggregate_id, id)
    WHERE status = 'DEAD';
-- Reaper: old PUBLISHED rows, oldest first.
CREATE INDEX outbox_event_published_idx ON outbox_event (published_at)
    WHERE status = 'PUBLISHED';

-- Per-aggregate commit order. Sequence values are handed out when a row is
-- inserted, not when its transaction commits, so without help a producer
-- could commit event k+1 of an aggregate while event k (smaller id) is still
-- uncommitted; a relay would then see k+1 as the head and publish it first.
-- The trigger takes a transaction-scoped advisory lock on the aggregate
-- before drawing the id: producers of one aggregate serialize, and an
-- aggregate's ids become visible in id order. Other aggregates are not
-- affected, and the relay needs no global snapshot horizon (xmin), so an
-- unrelated long transaction cannot stall it.
--
-- The id MUST be drawn here, after the lock: column defaults are evaluated
-- before BEFORE triggers run, so a nextval() default would let two racing
-- producers draw ids in one order and commit in the other.
--
-- Lock key: (7304564, hashtext(type || ':' || id)). The two-key form keeps
-- these locks apart from single-key advisory locks of the application; a
-- hash collision only makes two aggregates' producers wait for each other.
-- A transaction that appends to several aggregates should do so in a
-- consistent order, as with row locks, or it may deadlock with another.
-- +goose StatementBegin
CREATE FUNCTION outbox_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7304564, hashtext(NEW.aggregate_type || ':' || NEW.aggregate_id));
    NEW.id := nextval('outbox_event_id_seq');
    -- Relay-owned columns start clean whatever the producer sent.
    NEW.status := 'PENDING';
    NEW.attempts := 0;
    NEW.next_attempt_at := now();
    NEW.claimed_by := NULL;
    NEW.last_error := NULL;
    NEW.published_at := NULL;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_event_before_insert BEFORE INSERT ON outbox_event
    FOR EACH ROW EXECUTE FUNCTION outbox_event_before_insert();

-- Wake-up: one payload-less notification per inserting statement. NOTIFY is
-- delivered at commit and identical notifications in one transaction fold
-- into one, so a bulk insert costs a single message. Relays also poll, so
-- dropping this trigger only adds latency.
-- +goose StatementBegin
CREATE FUNCTION outbox_event_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_event', '');
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_event_notify AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();

-- +goose Down
DROP TABLE outbox_event;
DROP FUNCTION outbox_event_notify();
DROP FUNCTION outbox_event_before_insert();
