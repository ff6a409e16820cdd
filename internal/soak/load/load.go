// Package load is the steady work the database-fault tests and the soak
// give a pair of worker replicas, and the checks of its promises: outbox
// events over many aggregates to a webhook receiver (none lost, each
// aggregate in order), webhook deliveries to the inbox and sql tasks (each
// applied exactly once), and a sql job under leases (no run overlapping
// another, no fencing token used twice). Every writer rides out a database
// outage by retrying, and never commits a piece of work twice: each
// transaction also writes a mark the writer checks after an error whose
// outcome it cannot know.
package load

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Schema is what the load writes and the checks read, beside the worker's
// own tables. The job's marks have a deferred trigger that records each
// run's commit time (clock_timestamp() inside COMMIT).
const Schema = `
CREATE TABLE load_produced (batch bigint PRIMARY KEY);
CREATE TABLE load_inbox_applied (id text NOT NULL);
CREATE INDEX ON load_inbox_applied (id);
CREATE TABLE load_task_sent (n bigint PRIMARY KEY);
CREATE TABLE load_task_effect (n bigint NOT NULL);
CREATE INDEX ON load_task_effect (n);
CREATE TABLE load_job_mark (
    token bigint      NOT NULL,
    phase text        NOT NULL,
    at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE load_job_commit (token bigint NOT NULL, committed_at timestamptz NOT NULL);
CREATE FUNCTION load_job_committing() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO load_job_commit VALUES (NEW.token, clock_timestamp());
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER load_job_commit AFTER INSERT ON load_job_mark
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.phase = 'end')
    EXECUTE FUNCTION load_job_committing();`

// JobName is the sql job's name.
const JobName = "load-fenced"

// TaskKind is the sql task kind's name.
const TaskKind = "load_effect"

// WorkerConfig is a replica's configuration file: the job every 500 ms,
// the task kind, and the inbox's webhook source on inboxAddr, signed with
// secret (its base64 text).
func WorkerConfig(inboxAddr, secret string) string {
	return fmt.Sprintf(`jobs:
  - name: %s
    kind: sql
    delay: 500ms
    lease_ttl: 5s
    timeout: 10s
    sql: |
      INSERT INTO load_job_mark (token, phase) VALUES (current_setting('worker.fencing_token')::bigint, 'start');
      SELECT pg_sleep(0.05);
      INSERT INTO load_job_mark (token, phase) VALUES (current_setting('worker.fencing_token')::bigint, 'end');
tasks:
  kinds:
    - name: %s
      type: sql
      max_attempts: 25
      sql: INSERT INTO load_task_effect SELECT ($1->>'n')::bigint
inbox:
  sources:
    - name: partner
      kind: webhook
      webhook: {addr: %q, path: /hooks, secret: whsec_%s}
      handler:
        kind: sql
        sql: INSERT INTO load_inbox_applied (id) VALUES (@id)
`, JobName, TaskKind, inboxAddr, secret)
}

// retry runs f until it succeeds or ctx ends, pausing between attempts.
// done reports whether an attempt whose error hid its outcome committed.
func retry(ctx context.Context, f func() error, done func() (bool, error)) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		for {
			ok, derr := done()
			if derr == nil {
				if ok {
					return nil
				}
				break
			}
			if !sleep(ctx, 100*time.Millisecond) {
				return ctx.Err()
			}
		}
		if !sleep(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func exists(ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var ok bool
	err := pool.QueryRow(ctx, sql, args...).Scan(&ok)
	return ok, err
}
