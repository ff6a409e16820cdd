-- +goose Up
-- Fencing of the Redis lease provider (internal/lock; see docs/lock.md,
-- "Redis provider"). The Redis provider's leases live in Redis, so a
-- commit cannot lock them the way the PostgreSQL provider's fence locks
-- its worker_lock row. Instead every fenced commit records its grant's
-- token here, in its own transaction, and is refused if a later grant of
-- the key (a higher token) has committed, or is committing, before it.
-- The row lock taken by the upsert serialises concurrent fenced commits of
-- one key.
CREATE TABLE lock_fence (
    key   text   NOT NULL,
    token bigint NOT NULL,
    owner text   NOT NULL,
    CONSTRAINT lock_fence_pkey PRIMARY KEY (key),
    CONSTRAINT lock_fence_token_positive CHECK (token > 0)
);

COMMENT ON TABLE lock_fence IS 'Highest fencing token that committed under each Redis lease key (internal/lock). A commit with a lower token is refused.';
COMMENT ON COLUMN lock_fence.token IS 'Highest token of the key that committed, from the key''s counter in Redis.';
COMMENT ON COLUMN lock_fence.owner IS 'Provider instance of that grant: a second grant with the same token (Redis lost the counter''s last increment in a failover) is refused too.';

-- +goose Down
DROP TABLE lock_fence;
