package jobs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Every time in job_state comes from the database clock (now() in a
// single-statement transaction), never from a replica's clock, so replicas
// with skewed clocks still agree on when a job is due. Durations travel as
// microseconds to keep the SQL free of interval encoding questions.

const outcomeRunning = "running"

// store reads and writes job_state. Writes that end a run are fenced by the
// lease token, so a run that lost its lease cannot overwrite the state of
// the run that took over.
type store struct{ pool *pgxpool.Pool }

func micros(d time.Duration) int64 { return d.Microseconds() }

// register makes sure every job has a row, so `jobs list` shows a job
// before its first run, and records the configured delay.
func (s store) register(ctx context.Context, name string, delay time.Duration) error {
	_, err := s.pool.Exec(ctx, `
INSERT INTO job_state (name, delay, next_due_at) VALUES ($1, $2::bigint * interval '1 microsecond', now())
ON CONFLICT (name) DO UPDATE SET
    delay = EXCLUDED.delay,
    next_due_at = CASE WHEN job_state.last_outcome = 'running' THEN NULL
                       ELSE COALESCE(job_state.last_finished_at + EXCLUDED.delay, job_state.next_due_at) END,
    updated_at = now()`, name, micros(delay))
	return err
}

// previous describes a run found unfinished by the next lease holder.
type previous struct {
	Instance string
	Token    int64
	RunID    string
}

// due reports how long until the job is due (<= 0: due now). The caller
// holds the lease, so a row still marked running belongs to a run whose
// holder died or lost its lease without recording the end: due marks it
// abandoned now and counts the delay from now, as if it had just ended.
func (s store) due(ctx context.Context, name string, delay time.Duration) (time.Duration, *previous, error) {
	var (
		outcome, instance, runID *string
		token, remaining         *int64
	)
	err := s.pool.QueryRow(ctx, `
SELECT last_outcome, last_instance, last_token, last_run_id::text,
       ceil(EXTRACT(EPOCH FROM (last_finished_at + $2::bigint * interval '1 microsecond' - now())) * 1000000)::bigint
FROM job_state WHERE name = $1`, name, micros(delay)).Scan(&outcome, &instance, &token, &runID, &remaining)
	if errors.Is(err, pgx.ErrNoRows) {
		// Someone deleted the row (an operator resetting the job): start over.
		return 0, nil, s.register(ctx, name, delay)
	}
	if err != nil {
		return 0, nil, err
	}
	if outcome != nil && *outcome == outcomeRunning {
		prev := &previous{Instance: deref(instance), RunID: deref(runID)}
		if token != nil {
			prev.Token = *token
		}
		_, err := s.pool.Exec(ctx, `
UPDATE job_state SET last_finished_at = now(), last_outcome = 'abandoned',
    last_error = 'the run never recorded its end; its lease expired or was lost (replica crashed or cut off)',
    next_due_at = now() + $3::bigint * interval '1 microsecond', updated_at = now()
WHERE name = $1 AND last_outcome = 'running' AND last_token IS NOT DISTINCT FROM $2`, name, token, micros(delay))
		return delay, prev, err
	}
	if remaining == nil { // never finished a run
		return 0, nil, nil
	}
	return time.Duration(*remaining) * time.Microsecond, nil, nil
}

// start records the start of a run. The WHERE clause re-checks that the job
// is due on the database clock, so the lower bound of the fixed delay holds
// even if this replica's timer fired early; false means not due.
func (s store) start(ctx context.Context, name string, delay time.Duration, instance string, token int64, runID string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `
UPDATE job_state SET last_started_at = now(), last_outcome = 'running', last_instance = $3,
    last_token = $4, last_run_id = $5, last_error = NULL, next_due_at = NULL, updated_at = now()
WHERE name = $1 AND last_outcome IS DISTINCT FROM 'running'
  AND (last_finished_at IS NULL OR last_finished_at + $2::bigint * interval '1 microsecond' <= now())`,
		name, micros(delay), instance, token, runID)
	return tag.RowsAffected() == 1, err
}

// finish records the end of a run. It only touches the row if the run's
// token is still the last one: false means another holder took over.
func (s store) finish(ctx context.Context, name string, delay time.Duration, token int64, outcome, errText string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `
UPDATE job_state SET last_finished_at = now(), last_outcome = $3, last_error = NULLIF($4, ''),
    next_due_at = now() + $5::bigint * interval '1 microsecond', updated_at = now()
WHERE name = $1 AND last_token = $2`, name, token, outcome, errText, micros(delay))
	return tag.RowsAffected() == 1, err
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Status is one job's row as `worker jobs list` shows it. Zero times mean
// "never".
type Status struct {
	Name           string
	Delay          time.Duration
	LastStartedAt  time.Time
	LastFinishedAt time.Time
	LastOutcome    string // running, success, failure, timeout, lease_lost, cancelled, abandoned, or "" before the first run
	LastInstance   string
	LastToken      int64
	LastError      string
	NextDueAt      time.Time // zero while running: due delay after the run ends
}

// Running reports whether a run is in progress (or its replica died and no
// other replica has noticed yet).
func (s Status) Running() bool { return s.LastOutcome == outcomeRunning }

// List reads every job's state from the database. It is cluster-wide and
// needs only the pool, so it works from any machine.
func List(ctx context.Context, pool *pgxpool.Pool) ([]Status, error) {
	rows, err := pool.Query(ctx, `
SELECT name, (EXTRACT(EPOCH FROM delay) * 1000000)::bigint, last_started_at, last_finished_at,
       COALESCE(last_outcome, ''), COALESCE(last_instance, ''), COALESCE(last_token, 0),
       COALESCE(last_error, ''), next_due_at
FROM job_state ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	var out []Status
	for rows.Next() {
		var (
			st                       Status
			delayUS                  int64
			started, finished, nextD *time.Time
		)
		if err := rows.Scan(&st.Name, &delayUS, &started, &finished, &st.LastOutcome, &st.LastInstance,
			&st.LastToken, &st.LastError, &nextD); err != nil {
			return nil, fmt.Errorf("list jobs: %w", err)
		}
		st.Delay = time.Duration(delayUS) * time.Microsecond
		st.LastStartedAt, st.LastFinishedAt, st.NextDueAt = orZero(started), orZero(finished), orZero(nextD)
		out = append(out, st)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	return out, nil
}

func orZero(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.UTC()
}

// StatusJSON is one item of `worker jobs list --output json`;
// docs/operations.md shows it. Every key is always present.
type StatusJSON struct {
	Name           string     `json:"name"`
	Delay          string     `json:"delay"` // as in the configuration: 30s, 1m0s
	DelaySeconds   float64    `json:"delay_seconds"`
	LastStartedAt  *time.Time `json:"last_started_at"`  // null before the first run
	LastFinishedAt *time.Time `json:"last_finished_at"` // null before the first run ends
	LastOutcome    string     `json:"last_outcome"`     // "" before the first run
	LastInstance   string     `json:"last_instance"`
	LastToken      int64      `json:"last_token"`
	LastError      string     `json:"last_error"`
	NextDueAt      *time.Time `json:"next_due_at"` // null while running: due delay after the run ends
	Running        bool       `json:"running"`
}

// JSON is s as `jobs list --output json` prints it.
func (s Status) JSON() StatusJSON {
	out := StatusJSON{Name: s.Name, Delay: s.Delay.String(), DelaySeconds: s.Delay.Seconds(),
		LastStartedAt: timeOrNull(s.LastStartedAt), LastFinishedAt: timeOrNull(s.LastFinishedAt),
		LastOutcome: s.LastOutcome, LastInstance: s.LastInstance, LastToken: s.LastToken, LastError: s.LastError,
		NextDueAt: timeOrNull(s.NextDueAt), Running: s.Running()}
	if s.Running() {
		out.NextDueAt = nil
	}
	return out
}

func timeOrNull(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}

// PrintList writes statuses as an aligned table, then how many there are.
func PrintList(w io.Writer, list []Status) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tDELAY\tLAST START\tLAST FINISH\tOUTCOME\tINSTANCE\tNEXT DUE\tLAST ERROR")
	for _, s := range list {
		next := stamp(s.NextDueAt)
		if s.Running() {
			next = "after this run"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Name, s.Delay, stamp(s.LastStartedAt),
			stamp(s.LastFinishedAt), dash(s.LastOutcome), dash(s.LastInstance), next, dash(oneLine(s.LastError, 60)))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d job(s)\n", len(list))
	return err
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine keeps a table row on one line and bounded in width.
func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > max {
		return string(r[:max-1]) + "…"
	}
	return s
}
