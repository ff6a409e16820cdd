-- +goose Up
-- The inbox (internal/inbox; docs/inbox.md): one row per message a
-- consumer received, keyed by the message's CloudEvents source and id (or
-- a configured key for foreign messages). The row is claimed in a short
-- transaction of its own (RECEIVED, with a lease), marked PROCESSING, and
-- turned PROCESSED by the transaction that does the message's work, so the
-- work and the dedupe record commit together. PROCESSED rows keep only
-- their key until retention removes them.
CREATE TABLE inbox_message (
    consumer    text        NOT NULL, -- inbox.sources[].name
    msg_source  text        NOT NULL, -- CloudEvents source, or '' for a configured key
    msg_id      text        NOT NULL, -- CloudEvents id, or the configured key's value
    state       text        NOT NULL DEFAULT 'RECEIVED',
    attempts    integer     NOT NULL DEFAULT 0,
    owner       text,                 -- instance.id of the lease holder
    lease_token bigint,               -- one per claim, from inbox_lease_token_seq
    lease_until timestamptz,          -- judged by the database clock
    order_key   text        NOT NULL DEFAULT '',
    msg_type    text        NOT NULL DEFAULT '',
    origin      text        NOT NULL DEFAULT '', -- subject, topic, queue or path
    headers     jsonb       NOT NULL DEFAULT '{}',
    body        bytea,                -- kept while an operator may need it
    last_error  text,
    received_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,          -- PROCESSED, DEAD, RECOVERY_REQUIRED or RESOLVED since
    CONSTRAINT inbox_message_pkey PRIMARY KEY (consumer, msg_source, msg_id),
    CONSTRAINT inbox_message_state_valid CHECK (state IN
        ('RECEIVED', 'PROCESSING', 'FAILED', 'PROCESSED', 'DEAD', 'RECOVERY_REQUIRED', 'RESOLVED')),
    CONSTRAINT inbox_message_id_not_empty CHECK (msg_id <> ''),
    CONSTRAINT inbox_message_attempts_not_negative CHECK (attempts >= 0),
    CONSTRAINT inbox_message_lease_held CHECK (
        state NOT IN ('RECEIVED', 'PROCESSING', 'FAILED')
        OR (owner IS NOT NULL AND lease_token IS NOT NULL AND lease_until IS NOT NULL)),
    CONSTRAINT inbox_message_finished_at_set CHECK (
        (state IN ('RECEIVED', 'PROCESSING', 'FAILED')) = (finished_at IS NULL))
);

-- Retention deletes finished dedupe records oldest first, in bounded
-- batches; operators list DEAD and RECOVERY_REQUIRED rows. One partial
-- index serves both, and only finished rows are in it.
CREATE INDEX inbox_message_finished_idx ON inbox_message (state, finished_at)
    WHERE finished_at IS NOT NULL;

-- Claims in progress whose lease expired are found through this index,
-- which holds only unfinished rows: a few per message in flight.
CREATE INDEX inbox_message_lease_idx ON inbox_message (lease_until)
    WHERE finished_at IS NULL;

CREATE SEQUENCE inbox_lease_token_seq;

-- +goose Down
DROP SEQUENCE IF EXISTS inbox_lease_token_seq;
DROP TABLE IF EXISTS inbox_message;
