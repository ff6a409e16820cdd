package tasks

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// Registry collects the task kinds written in Go. A Go kind is a
// river.Worker[T] registered with AddWorker; a `type: go` entry under
// tasks.kinds may set its queue, timeout and max_attempts.
type Registry struct {
	workers *river.Workers
	kinds   []string
}

// AddWorker registers a Go task kind, keyed by T's Kind().
func AddWorker[T river.JobArgs](r *Registry, w river.Worker[T]) error {
	var args T
	if err := river.AddWorkerSafely(r.workers, w); err != nil {
		return err
	}
	r.kinds = append(r.kinds, args.Kind())
	return nil
}

// rawArgs are the args of a configured (http, sql) kind: any JSON object,
// passed through as it was enqueued. The kind is known from the job row.
type rawArgs struct {
	kind string
	raw  json.RawMessage
}

func (a rawArgs) Kind() string { return a.kind }

func (a rawArgs) MarshalJSON() ([]byte, error) {
	if len(a.raw) == 0 {
		return []byte("{}"), nil
	}
	return a.raw, nil
}

func (a *rawArgs) UnmarshalJSON(b []byte) error {
	a.raw = append(a.raw[:0], b...)
	return nil
}

// retryPolicy is River's client retry policy for every kind: full-jitter
// exponential backoff. It counts errors rather than attempts, because a
// snooze or a shutdown interruption gives the attempt back.
type retryPolicy struct{ base, max time.Duration }

func (p retryPolicy) NextRetry(job *rivertype.JobRow) time.Time {
	return time.Now().Add(obs.FullJitter(p.base, p.max, len(job.Errors)+1))
}

// httpWorker runs an http kind: POST the args as JSON to the kind's URL.
// 2xx is success. An unavailable endpoint (a network error, a timeout,
// 408, 429, 502, 503, 504: broker.Unreachable, broker.UnavailableStatus)
// opens the kind's breaker and the task snoozes without spending an
// attempt, unless the failure is its own (endpointBreaker.ownFailure).
// 500 and the other 5xx are the task's failure (retried, honouring
// Retry-After); any other status is permanent (dead-lettered at once).
type httpWorker struct {
	river.WorkerDefaults[rawArgs]
	kind     tasksconfig.Kind
	client   *http.Client
	endpoint *endpointBreaker
	pool     *pgxpool.Pool // River's, to wake the tasks that waited
	// retryAt holds a Retry-After the endpoint asked for, from Work to
	// NextRetry, which River calls right after Work returns.
	retryAt sync.Map // job id -> time.Time
}

func (w *httpWorker) Work(ctx context.Context, job *river.Job[rawArgs]) error {
	lastWait := lastWaitOf(job.Metadata)
	call, probe := w.endpoint.admit()
	if !call {
		w.endpoint.waiting(lastWait)
		return w.snooze(ctx, job, time.Time{})
	}
	code, retryAt, err := w.post(ctx, job)
	switch {
	case err == nil && code >= 200 && code <= 299:
		if w.endpoint.succeeded() {
			w.wakeWaiting(ctx)
		}
		return nil
	case err != nil && ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded):
		// Shutdown or an operator's cancel: River decides; says nothing
		// about the endpoint.
		w.endpoint.release(probe)
		return err
	case err == nil && code >= 300 && !broker.UnavailableStatus(code) && code < 500:
		w.endpoint.release(probe)
		return river.JobCancel(fmt.Errorf("POST %s: status %d %s (permanent)", obs.RedactURL(w.kind.URL), code, http.StatusText(code)))
	}
	if err == nil {
		err = fmt.Errorf("POST %s: status %d %s", obs.RedactURL(w.kind.URL), code, http.StatusText(code))
	}
	if broker.Unreachable(err) || broker.UnavailableStatus(code) {
		if !w.endpoint.ownFailure(lastWait) {
			w.endpoint.unavailable(probe, err, retryAt)
			w.endpoint.waiting(lastWait)
			return w.snooze(ctx, job, retryAt)
		}
	}
	w.endpoint.release(probe)
	if !retryAt.IsZero() && job.Attempt < job.MaxAttempts {
		w.retryAt.Store(job.ID, retryAt)
	}
	return err
}

// post sends the task and returns the answer's status and Retry-After, or
// the error that kept it from getting one.
func (w *httpWorker) post(ctx context.Context, job *river.Job[rawArgs]) (code int, retryAt time.Time, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.kind.URL, bytes.NewReader(job.EncodedArgs))
	if err != nil {
		return 0, time.Time{}, river.JobCancel(fmt.Errorf("POST %s: %w", obs.RedactURL(w.kind.URL), err))
	}
	for k, v := range w.kind.Headers {
		req.Header.Set(k, v)
	}
	meta := MetaFrom(ctx)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Task-Id", strconv.FormatInt(job.ID, 10))
	req.Header.Set("X-Task-tasksconfig.Kind", job.Kind)
	req.Header.Set("X-Task-Attempt", strconv.Itoa(job.Attempt))
	for name, v := range map[string]string{"Traceparent": meta.Traceparent, "X-Request-Id": meta.RequestID,
		"X-Correlation-Id": meta.CorrelationID, "X-Tenant-Id": meta.TenantID} {
		if v != "" {
			req.Header.Set(name, v)
		}
	}
	resp, err := w.client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // url.Error repeats the URL, which may carry a token
		}
		return 0, time.Time{}, fmt.Errorf("POST %s: %w", obs.RedactURL(w.kind.URL), err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	retryAt, _ = retryAfter(resp.Header.Get("Retry-After"), time.Now())
	return resp.StatusCode, retryAt, nil
}

// snooze puts the task back without spending an attempt (River gives the
// attempt back on a snooze) for a backoff that grows with its snoozes, up
// to tasks.probe_backoff_max, or until the endpoint's Retry-After if that
// is later, and records when it waited.
func (w *httpWorker) snooze(ctx context.Context, job *river.Job[rawArgs], retryAt time.Time) error {
	now := time.Now()
	_ = river.MetadataSet(ctx, unavailableAtKey, now.UTC())
	d := max(backoff(probeBackoffBase, w.endpoint.max, snoozesOf(job.Metadata)+1), retryAt.Sub(now))
	return &endpointDownError{err: river.JobSnooze(d)}
}

// wakeWaiting makes the kind's snoozed tasks due now, once the endpoint is
// back: they would otherwise wait out the rest of their snooze, up to
// tasks.probe_backoff_max. Only tasks snoozed for their endpoint (with
// endpoint_unavailable_at) and already available to River (a snooze up to
// River's scheduler interval, 5s) are woken; a task scheduled for later on
// purpose is left alone. Best effort: a failure only costs that wait.
func (w *httpWorker) wakeWaiting(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	tag, err := w.pool.Exec(ctx, `UPDATE river_job SET scheduled_at = now()
		WHERE state = 'available' AND kind = $1 AND scheduled_at > now() AND metadata ? $2`, w.kind.Name, unavailableAtKey)
	log := w.endpoint.log.With("task_kind", w.kind.Name)
	if err != nil {
		log.Warn("could not wake the tasks that waited for the endpoint; they run when their snooze ends", "error", err)
		return
	}
	log.Debug("woke the tasks that waited for the endpoint", "tasks", tag.RowsAffected())
}

// endpointDownError is the snooze of a task whose endpoint is unavailable.
// River sees the snooze it wraps; the observer logs it at debug level
// only, since the breaker logs the outage once.
type endpointDownError struct{ err error }

func (e *endpointDownError) Error() string { return "endpoint unavailable: " + e.err.Error() }
func (e *endpointDownError) Unwrap() error { return e.err }

// Timeout is the kind's, for River's rescuer.
func (w *httpWorker) Timeout(*river.Job[rawArgs]) time.Duration { return w.kind.Timeout }

// NextRetry honours the endpoint's Retry-After; otherwise River asks the
// client's retryPolicy.
func (w *httpWorker) NextRetry(job *river.Job[rawArgs]) time.Time {
	if at, ok := w.retryAt.LoadAndDelete(job.ID); ok {
		return at.(time.Time)
	}
	return time.Time{}
}

// maxRetryAfter is the longest Retry-After in seconds that is honoured; a
// longer one falls back to the retry policy.
const maxRetryAfter = 100 * 365 * 24 * time.Hour

// retryAfter parses a Retry-After header: seconds or an HTTP date.
func retryAfter(v string, now time.Time) (time.Time, bool) {
	if v == "" {
		return time.Time{}, false
	}
	// Beyond maxRetryAfter, seconds would overflow time.Duration and come out
	// negative: a retry at once, the opposite of what the endpoint asked.
	if s, err := strconv.ParseInt(v, 10, 64); err == nil && s >= 0 && s <= int64(maxRetryAfter/time.Second) {
		return now.Add(time.Duration(s) * time.Second), true
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t, true
	}
	return time.Time{}, false
}

// sqlWorker runs a sql kind: the statement, with the args as $1 (jsonb),
// and the task's completion commit in one transaction. If the replica dies
// before the commit, neither happened and the task runs again; after it,
// both did. The statement's effect therefore happens exactly once.
type sqlWorker struct {
	river.WorkerDefaults[rawArgs]
	kind tasksconfig.Kind
	pool *pgxpool.Pool
}

func (w *sqlWorker) Work(ctx context.Context, job *river.Job[rawArgs]) error {
	err := pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		// $1 is declared jsonb when the statement is parsed, so the
		// statement can use it as jsonb without a cast ($1->>'order').
		conn := tx.Conn().PgConn()
		if _, err := conn.Prepare(ctx, "", w.kind.SQL, []uint32{pgtype.JSONBOID}); err != nil {
			return err
		}
		if res := conn.ExecPrepared(ctx, "", [][]byte{job.EncodedArgs}, []int16{pgtype.TextFormatCode}, nil).Read(); res.Err != nil {
			return res.Err
		}
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		return err
	})
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("sql task %s: %w", job.Kind, ctx.Err()) // timeout or shutdown
	case isPermanentSQLError(err):
		return river.JobCancel(fmt.Errorf("sql task %s: %w", job.Kind, err))
	}
	return fmt.Errorf("sql task %s: %w", job.Kind, err)
}

// Timeout is the kind's, for River's rescuer.
func (w *sqlWorker) Timeout(*river.Job[rawArgs]) time.Duration { return w.kind.Timeout }

// isPermanentSQLError is true for errors a retry cannot fix: bad data (22),
// a violated constraint (23), a wrong statement or missing object (42).
func isPermanentSQLError(err error) bool {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || len(pg.Code) < 2 {
		return false
	}
	switch pg.Code[:2] {
	case "22", "23", "42":
		return true
	}
	return false
}
