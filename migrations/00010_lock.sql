-- +goose Up
-- Distributed leases. expires_at is always computed from the database
-- clock (now()), never from a replica's clock.
CREATE TABLE worker_lock (
    key         text PRIMARY KEY,
    token       bigint      NOT NULL,
    owner       text        NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);

-- +goose Down
DROP TABLE worker_lock;
