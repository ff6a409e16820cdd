-- +goose Up
-- Enqueueing tasks from any language. A producer calls, inside its own
-- transaction:
--
--   SELECT worker_enqueue('send-receipt', '{"order": 42}'::jsonb,
--                         metadata => '{"request_id": "..."}');
--
-- which inserts the same river_job row River's own insert (InsertTx) would
-- (its times from the database's clock rather than the producer's), and the
-- same insert notification, so a worker replica runs the task once
-- the transaction commits. River's tables are created by rivermigrate after
-- these migrations; PL/pgSQL resolves them when the function first runs.

-- What the enqueue path needs from the workers' configuration (tasks.kinds,
-- tasks.queues, tasks.max_attempts). Every replica writes its configuration
-- here at start; replicas are expected to share one configuration.
CREATE TABLE worker_task_kind (
    kind         text    PRIMARY KEY, -- '*' holds the defaults for other kinds
    queue        text    NOT NULL,
    max_attempts integer NOT NULL CHECK (max_attempts >= 1)
);
CREATE TABLE worker_task_queue (
    queue       text    PRIMARY KEY,
    max_backlog integer NOT NULL CHECK (max_backlog >= 0) -- 0: unbounded
);
INSERT INTO worker_task_kind VALUES ('*', 'default', 3);
INSERT INTO worker_task_queue VALUES ('default', 10000);

-- worker_task_admit resolves a task's queue and max_attempts (given value,
-- else the kind's configuration, else the defaults) and refuses the task
-- with SQLSTATE WK001 (JOB_EXECUTOR_REJECTED) when the queue's available
-- backlog is at its max_backlog. The count stops at max_backlog, so its cost
-- is bounded however large the table grows. The Go helper and the CLI call
-- it too: one admission rule for every producer.
-- +goose StatementBegin
CREATE FUNCTION worker_task_admit(task_kind text, task_queue text, task_max_attempts integer,
                                  OUT queue text, OUT max_attempts integer)
LANGUAGE plpgsql AS $$
DECLARE
    cap     integer;
    backlog integer;
BEGIN
    SELECT coalesce(nullif(task_queue, ''), k.queue), coalesce(nullif(task_max_attempts, 0), k.max_attempts)
      INTO queue, max_attempts
      FROM worker_task_kind k
     WHERE k.kind IN (task_kind, '*')
     ORDER BY k.kind = '*'
     LIMIT 1;
    queue := coalesce(queue, nullif(task_queue, ''), 'default');
    max_attempts := coalesce(max_attempts, nullif(task_max_attempts, 0), 3);

    SELECT q.max_backlog INTO cap FROM worker_task_queue q WHERE q.queue = worker_task_admit.queue;
    IF coalesce(cap, 0) > 0 THEN
        SELECT count(*) INTO backlog FROM (
            SELECT 1 FROM river_job j
             WHERE j.state = 'available' AND j.queue = worker_task_admit.queue
             LIMIT cap) waiting;
        IF backlog >= cap THEN
            RAISE EXCEPTION 'JOB_EXECUTOR_REJECTED: queue % has % available tasks, its max_backlog; task % refused', queue, cap, task_kind
                USING ERRCODE = 'WK001', HINT = 'Retry later; see docs/runbooks/JOB_EXECUTOR_REJECTED.md';
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION worker_enqueue(kind text, args jsonb DEFAULT '{}', metadata jsonb DEFAULT '{}',
                               queue text DEFAULT NULL, max_attempts integer DEFAULT NULL,
                               priority integer DEFAULT 1, scheduled_at timestamptz DEFAULT NULL,
                               tags text[] DEFAULT '{}')
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    admitted record;
    job_state text;
    job_id    bigint;
    -- River's Go insert stamps created_at and scheduled_at with the
    -- inserting process's clock at the insert; this is the database's.
    inserted  timestamptz := clock_timestamp();
BEGIN
    -- River's insert rules (insertParamsFromConfigArgsAndOptions).
    IF coalesce(kind, '') = '' THEN
        RAISE EXCEPTION 'worker_enqueue: kind must not be empty' USING ERRCODE = '22023';
    END IF;
    IF args IS NULL OR jsonb_typeof(args) <> 'object' THEN
        RAISE EXCEPTION 'worker_enqueue: args must be a JSON object' USING ERRCODE = '22023';
    END IF;
    IF metadata IS NULL OR jsonb_typeof(metadata) <> 'object' THEN
        RAISE EXCEPTION 'worker_enqueue: metadata must be a JSON object' USING ERRCODE = '22023';
    END IF;
    IF priority IS NULL OR priority NOT BETWEEN 1 AND 4 THEN
        RAISE EXCEPTION 'worker_enqueue: priority must be between 1 and 4' USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(tags) t WHERE t IS NULL OR length(t) > 255 OR t !~ '^\w[\w\-]+\w$') THEN
        RAISE EXCEPTION 'worker_enqueue: tags must match ^\w[\w\-]+\w$ and be at most 255 characters' USING ERRCODE = '22023';
    END IF;
    IF queue IS NOT NULL AND (length(queue) > 64 OR queue !~ '^[a-z0-9]+([_|\-]?[a-z0-9]+)*$') THEN
        RAISE EXCEPTION 'worker_enqueue: queue name is invalid, expected letters and numbers separated by underscores or hyphens: %', queue USING ERRCODE = '22023';
    END IF;
    IF max_attempts IS NOT NULL AND max_attempts < 1 THEN
        RAISE EXCEPTION 'worker_enqueue: max_attempts must be at least 1' USING ERRCODE = '22023';
    END IF;

    SELECT * INTO admitted FROM worker_task_admit(kind, queue, max_attempts);
    job_state := CASE WHEN scheduled_at IS NULL THEN 'available' ELSE 'scheduled' END;

    INSERT INTO river_job (args, created_at, kind, max_attempts, metadata, priority, queue, scheduled_at, state, tags)
    VALUES (worker_enqueue.args, inserted, worker_enqueue.kind, admitted.max_attempts, worker_enqueue.metadata,
            worker_enqueue.priority, admitted.queue, coalesce(worker_enqueue.scheduled_at, inserted), job_state::river_job_state,
            worker_enqueue.tags::varchar(255)[])
    RETURNING id INTO job_id;

    -- River's insert notification, byte for byte; it is delivered when the
    -- transaction commits, and wakes the queue's producers at once.
    IF job_state = 'available' THEN
        PERFORM pg_notify(current_schema() || '.river_insert', format('{"queue": %s}', to_json(admitted.queue)));
    END IF;
    RETURN job_id;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION worker_enqueue(text, jsonb, jsonb, text, integer, integer, timestamptz, text[]);
DROP FUNCTION worker_task_admit(text, text, integer);
DROP TABLE worker_task_queue;
DROP TABLE worker_task_kind;
