-- +goose Up
-- Distributed leases (internal/lock; see docs/lock.md).
--
-- Fencing tokens come from one global sequence, never from the row: a
-- sequence never goes back, so a key's tokens keep increasing across
-- takeovers, restarts, and the reaper deleting the row.
CREATE SEQUENCE worker_lock_token_seq AS bigint;

-- One row per key. A lease is held while expires_at is in the future by the
-- DATABASE clock; every statement computes and compares it with
-- clock_timestamp(), never with a replica's clock. Release sets expires_at
-- to the release time, so the row (and its token) stays for the record, and
-- the next acquire is a single-row UPDATE. A key's first acquire writes the
-- row as never granted (token 0, already expired) and then takes it like
-- any released row, so every token is drawn after its row exists.
-- Only the primary key is indexed, so acquires, renewals and releases are
-- HOT updates; the low fillfactor leaves room on the page for them.
CREATE TABLE worker_lock (
    key         text        PRIMARY KEY,
    token       bigint      NOT NULL,
    owner       text        NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    awaited     boolean     NOT NULL DEFAULT false
) WITH (fillfactor = 50);

COMMENT ON TABLE worker_lock IS 'Distributed leases of the worker (internal/lock). Held while expires_at > clock_timestamp().';
COMMENT ON COLUMN worker_lock.token IS 'Fencing token of the current (or last) grant, from worker_lock_token_seq; strictly increasing per key. 0: never granted.';
COMMENT ON COLUMN worker_lock.owner IS 'Provider instance holding (or last holding) the key: instance id plus a random part.';
COMMENT ON COLUMN worker_lock.expires_at IS 'Database-clock expiry; set to the release time on release.';
COMMENT ON COLUMN worker_lock.awaited IS 'A waiter is parked on this grant: its release sends NOTIFY worker_lock.';

-- +goose Down
DROP TABLE worker_lock;
DROP SEQUENCE worker_lock_token_seq;
