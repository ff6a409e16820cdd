package jobs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/obs"
)

// FromDefinitions turns the jobs under `jobs:` in configs/worker.yaml into
// Specs, leaving out disabled ones. It validates first, so it returns the
// same errors as ValidateDefinitions. httpClient may be nil; the run's
// context bounds each call either way.
func FromDefinitions(defs []jobsconfig.Definition, pool *pgxpool.Pool, httpClient *http.Client) ([]Spec, error) {
	if err := jobsconfig.ValidateDefinitions(defs); err != nil {
		return nil, err
	}
	// Redirects are not followed: a 3xx is a failure ("anything else than
	// 2xx"), and following one would send the job's headers, which often
	// carry credentials, to wherever the redirect points. (The webhook sink
	// does the same.) A shallow copy leaves the caller's client alone.
	c := &http.Client{}
	if httpClient != nil {
		cp := *httpClient
		c = &cp
	}
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	httpClient = c
	var specs []Spec
	for _, d := range defs {
		if !d.IsEnabled() {
			continue
		}
		var j Job
		switch d.Kind {
		case jobsconfig.KindSQL:
			if pool == nil {
				return nil, fmt.Errorf("jobs: sql job %q needs a database pool", d.Name)
			}
			j = &SQLJob{JobName: d.Name, SQL: d.SQL, Pool: pool}
		case jobsconfig.KindHTTP:
			method := strings.ToUpper(d.Method)
			if method == "" {
				method = http.MethodGet
			}
			j = &HTTPJob{JobName: d.Name, Method: method, URL: d.URL, Headers: d.Headers, Client: httpClient}
		}
		specs = append(specs, Spec{Job: j, Delay: d.Delay, InitialDelay: d.InitialDelay, Timeout: d.Timeout, LeaseTTL: d.LeaseTTL})
	}
	return specs, nil
}

// SQLJob runs SQL (one or more statements) in one transaction, through
// InTx: the transaction-local settings worker.fencing_token and
// worker.run_id are set, so the SQL can guard its writes with
// current_setting('worker.fencing_token')::bigint, statement_timeout
// backs up the job's timeout on the server, and the COMMIT is fenced by
// the run's lease. The SQL must not contain transaction control (COMMIT,
// ROLLBACK).
type SQLJob struct {
	JobName string
	SQL     string
	Pool    *pgxpool.Pool
}

// Name implements Job.
func (j *SQLJob) Name() string { return j.JobName }

// Run implements Job.
func (j *SQLJob) Run(ctx context.Context) error {
	return InTx(ctx, j.Pool, func(tx pgx.Tx) error {
		// No arguments: pgx uses the simple protocol, which allows several
		// statements in one string.
		_, err := tx.Exec(ctx, j.SQL)
		return err
	})
}

// Headers of every http job call. A database cannot fence an HTTP call, so
// the receiver does: it should reject a call whose token is lower than the
// highest it has seen for the job (docs/jobs.md).
const (
	HeaderFencingToken = "Worker-Fencing-Token"
	HeaderRunID        = "Worker-Run-Id"
)

// HTTPJob calls a URL; any 2xx status is success. It sends the run's
// fencing token and run id as HeaderFencingToken and HeaderRunID.
type HTTPJob struct {
	JobName string
	Method  string
	URL     string
	Headers map[string]string
	Client  *http.Client
}

// Name implements Job.
func (j *HTTPJob) Name() string { return j.JobName }

// Run implements Job.
func (j *HTTPJob) Run(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, j.Method, j.URL, nil)
	if err != nil {
		return fmt.Errorf("%s %s: %w", j.Method, obs.RedactURL(j.URL), err)
	}
	for k, v := range j.Headers {
		if http.CanonicalHeaderKey(k) == "Host" {
			req.Host = v // Go sends req.Host and ignores a Host entry in the header map
			continue
		}
		req.Header.Set(k, v)
	}
	// Set last, so configured headers cannot forge them. The receiver
	// fences with the token: see docs/jobs.md.
	if ri, ok := runOf(ctx); ok {
		req.Header.Set(HeaderFencingToken, strconv.FormatInt(ri.lease.Token(), 10))
		req.Header.Set(HeaderRunID, ri.runID)
	}
	resp, err := j.Client.Do(req)
	if err != nil {
		// url.Error repeats the full URL, which may carry a token; report
		// only its cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("%s %s: %w", j.Method, obs.RedactURL(j.URL), err)
	}
	// Drain a bounded amount so the connection can be reused.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("%s %s: status %s; want 2xx", j.Method, obs.RedactURL(j.URL), resp.Status)
	}
	return nil
}
