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

	"worker/internal/obs"
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
// 2xx is success; 408, 429 and 5xx are transient (retried, honouring
// Retry-After); any other status is permanent (dead-lettered at once).
type httpWorker struct {
	river.WorkerDefaults[rawArgs]
	kind   Kind
	client *http.Client
	// retryAt holds a Retry-After the endpoint asked for, from Work to
	// NextRetry, which River calls right after Work returns.
	retryAt sync.Map // job id -> time.Time
}

func (w *httpWorker) Work(ctx context.Context, job *river.Job[rawArgs]) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.kind.URL, bytes.NewReader(job.EncodedArgs))
	if err != nil {
		return river.JobCancel(fmt.Errorf("POST %s: %w", redact(w.kind.URL), err))
	}
	for k, v := range w.kind.Headers {
		req.Header.Set(k, v)
	}
	meta := MetaFrom(ctx)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Task-Id", strconv.FormatInt(job.ID, 10))
	req.Header.Set("X-Task-Kind", job.Kind)
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
		return fmt.Errorf("POST %s: %w", redact(w.kind.URL), err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	code := resp.StatusCode
	switch {
	case code >= 200 && code <= 299:
		return nil
	case code == http.StatusRequestTimeout || code == http.StatusTooManyRequests || code >= 500:
		if at, ok := retryAfter(resp.Header.Get("Retry-After"), time.Now()); ok && job.Attempt < job.MaxAttempts {
			w.retryAt.Store(job.ID, at)
		}
		return fmt.Errorf("POST %s: status %s (transient)", redact(w.kind.URL), resp.Status)
	}
	return river.JobCancel(fmt.Errorf("POST %s: status %s (permanent)", redact(w.kind.URL), resp.Status))
}

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

// redact keeps a URL's scheme, host and path: user info and query may
// carry credentials.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(invalid URL)"
	}
	return u.Scheme + "://" + u.Host + u.Path
}

// sqlWorker runs a sql kind: the statement, with the args as $1 (jsonb),
// and the task's completion commit in one transaction. If the replica dies
// before the commit, neither happened and the task runs again; after it,
// both did. The statement's effect therefore happens exactly once.
type sqlWorker struct {
	river.WorkerDefaults[rawArgs]
	kind Kind
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
