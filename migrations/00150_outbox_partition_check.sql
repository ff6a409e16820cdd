-- +goose Up
-- An insert into outbox_event needs a partition for its time (created_at,
-- the start of the producer's transaction); the outbox-partitions job of
-- the worker creates them ahead (internal/outbox, partitions.go). When
-- they run out, PostgreSQL's own refusal, `no partition of relation
-- "outbox_event" found for row`, names neither the job nor the alert.
-- PostgreSQL routes a row to its partition before any row trigger runs, so
-- the check is a statement trigger that runs before routing: it refuses
-- the statement with the same SQLSTATE (23514, check_violation), under a
-- constraint name of its own, with where to look. One probe of the small
-- outbox_partition table per statement, not per row.
--
-- A DEFAULT partition with a CHECK that refuses every row would name the
-- constraint too, but a partitioned table with a default partition cannot
-- detach partitions CONCURRENTLY, which retention relies on so that
-- producers never wait for it.
-- +goose StatementBegin
CREATE FUNCTION outbox_event_partition_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT coalesce((SELECT hi > now() FROM outbox_partition WHERE lo <= now() ORDER BY lo DESC LIMIT 1), false) THEN
        RAISE check_violation USING
            MESSAGE = format('no outbox_event partition covers %s: the outbox-partitions job of the worker has not created it',
                             to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')),
            DETAIL = 'Partitions are created ahead of time by a running worker (outbox.partition_interval, outbox.partitions_ahead); the alert WorkerOutboxPartitionsRunningOut fires before they run out.',
            HINT = 'Check that a worker runs and that its outbox-partitions job succeeds; see docs/runbooks/WorkerOutboxPartitionsRunningOut.md.',
            CONSTRAINT = 'outbox_event_no_partition_ahead', TABLE = 'outbox_event';
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_event_partition_check BEFORE INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_partition_check();

-- +goose Down
DROP TRIGGER IF EXISTS outbox_event_partition_check ON outbox_event;
DROP FUNCTION IF EXISTS outbox_event_partition_check();
