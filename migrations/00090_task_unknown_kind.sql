-- +goose Up
-- A task of a kind that no worker configuration knows waits for ever (River
-- fetches only the kinds a replica runs) and counts against its queue's
-- max_backlog. worker_task_admit, which every enqueue path calls
-- (worker_enqueue, the Go helper, the CLI), now raises a NOTICE for such a
-- kind. "Known" means a row in worker_task_kind: every replica that runs
-- tasks writes its configured and Go-registered kinds there at start. The
-- task is still inserted, so a producer deployed before the workers that
-- run its kind keeps working.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION worker_task_admit(task_kind text, task_queue text, task_max_attempts integer,
                                             OUT queue text, OUT max_attempts integer)
LANGUAGE plpgsql AS $$
DECLARE
    cap     integer;
    backlog integer;
    matched text;
BEGIN
    SELECT k.kind, coalesce(nullif(task_queue, ''), k.queue), coalesce(nullif(task_max_attempts, 0), k.max_attempts)
      INTO matched, queue, max_attempts
      FROM worker_task_kind k
     WHERE k.kind IN (task_kind, '*')
     ORDER BY k.kind = '*'
     LIMIT 1;
    IF matched IS DISTINCT FROM task_kind THEN
        RAISE NOTICE 'task kind % is not known to any worker configuration (worker_task_kind); the task waits until a replica runs that kind', task_kind
            USING HINT = 'Add the kind under tasks.kinds (or register it in Go) and restart the workers; see docs/tasks.md';
    END IF;
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

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION worker_task_admit(task_kind text, task_queue text, task_max_attempts integer,
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
