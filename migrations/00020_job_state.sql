-- +goose Up
-- One row per scheduled job: the cluster-wide memory of its last run. The
-- replica holding lease job:<name> reads it to decide whether the job is due
-- (last_finished_at + delay, on the database clock) and writes the start and
-- the end of each run before releasing the lease. `worker jobs list` reads it.
CREATE TABLE job_state (
    name             text PRIMARY KEY,
    delay            interval    NOT NULL,
    last_started_at  timestamptz,
    last_finished_at timestamptz,
    -- running while a run is in progress; then success, failure, timeout,
    -- lease_lost, cancelled, or abandoned (its replica died mid-run).
    last_outcome     text,
    last_instance    text,
    last_token       bigint,
    last_run_id      uuid,
    last_error       text,
    -- NULL while running: the next run is due delay after this one ends.
    next_due_at      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE job_state;
