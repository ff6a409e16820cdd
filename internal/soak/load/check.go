package load

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Counts is what the database shows of the exactly-once work.
type Counts struct {
	InboxApplied, InboxDoubled, InboxMissing int // applied of the deliveries taken; doubled of all
	TaskApplied, TaskDoubled, TaskMissing    int // applied of the tasks enqueued; doubled of all
	JobRuns                                  int // committed runs of the sql job
	JobTokenTwice                            int // tokens with more than one committed run
	JobOverlaps                              int // runs that committed after a later token's run started
}

// Applied reads the inbox's and the tasks' effects: inboxSent deliveries
// were taken (in-0 … in-(inboxSent-1)) and tasksSent tasks enqueued.
func Applied(ctx context.Context, pool *pgxpool.Pool, inboxSent, tasksSent int) (Counts, error) {
	var c Counts
	err := pool.QueryRow(ctx, `SELECT
		(SELECT count(DISTINCT id) FROM load_inbox_applied WHERE substr(id, 4)::bigint < $1),
		(SELECT count(*) - count(DISTINCT id) FROM load_inbox_applied),
		(SELECT count(*) FROM generate_series(0, $1 - 1) k WHERE NOT EXISTS (SELECT 1 FROM load_inbox_applied WHERE id = 'in-' || k)),
		(SELECT count(DISTINCT n) FROM load_task_effect WHERE n < $2),
		(SELECT count(*) - count(DISTINCT n) FROM load_task_effect),
		(SELECT count(*) FROM load_task_sent s WHERE s.n < $2 AND NOT EXISTS (SELECT 1 FROM load_task_effect e WHERE e.n = s.n))`,
		inboxSent, tasksSent).Scan(&c.InboxApplied, &c.InboxDoubled, &c.InboxMissing, &c.TaskApplied, &c.TaskDoubled, &c.TaskMissing)
	return c, err
}

// Jobs checks the sql job's committed runs: a token committed twice, and
// a run that committed after a run with a later token started (an overlap,
// or a commit after its lease was lost).
func Jobs(ctx context.Context, pool *pgxpool.Pool, c *Counts) error {
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT token FROM load_job_commit GROUP BY token HAVING count(*) > 1) x`).
		Scan(&c.JobTokenTwice); err != nil {
		return err
	}
	rows, _ := pool.Query(ctx, `SELECT m.token, m.at, c.committed_at
		FROM load_job_mark m JOIN load_job_commit c USING (token) WHERE m.phase = 'start' ORDER BY m.token`)
	type run struct {
		token         int64
		start, commit time.Time
	}
	var r run
	var runs []run
	if _, err := pgx.ForEachRow(rows, []any{&r.token, &r.start, &r.commit}, func() error {
		runs = append(runs, r)
		return nil
	}); err != nil {
		return err
	}
	c.JobRuns = len(runs)
	// Runs are ordered by token; the latest commit so far must come before
	// each later run's start.
	var last run
	for i, b := range runs {
		if i > 0 && b.token > last.token && !last.commit.Before(b.start) {
			c.JobOverlaps++
		}
		if b.commit.After(last.commit) {
			last = b
		}
	}
	return nil
}

// Problems lists what breaks a promise; empty when every one holds.
func (c Counts) Problems() []string {
	var p []string
	add := func(n int, what string) {
		if n != 0 {
			p = append(p, fmt.Sprintf("%d %s", n, what))
		}
	}
	add(c.InboxDoubled, "inbox deliveries applied twice")
	add(c.InboxMissing, "inbox deliveries taken (200) but not applied")
	add(c.TaskDoubled, "sql tasks applied twice")
	add(c.TaskMissing, "sql tasks enqueued but not applied")
	add(c.JobTokenTwice, "fencing tokens with two committed runs")
	add(c.JobOverlaps, "job runs that committed after a later run started")
	return p
}
