package jobs

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/pgtest"
)

func TestHTTPJob(t *testing.T) {
	var (
		mu   sync.Mutex
		got  []string
		code = http.StatusNoContent
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("X-Token")+" "+r.Host)
		w.WriteHeader(code)
	}))
	defer srv.Close()

	specs, err := FromDefinitions([]jobsconfig.Definition{
		{Name: "post", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: srv.URL + "/hook", Method: "POST",
			Headers: map[string]string{"X-Token": "abc", "host": "billing.internal"}},
		{Name: "get", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: srv.URL + "/ping?key=hidden"},
	}, nil, srv.Client())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := specs[0].Job.Run(ctx); err != nil {
		t.Fatalf("204: %v", err)
	}
	if err := specs[1].Job.Run(ctx); err != nil {
		t.Fatalf("204: %v", err)
	}
	mu.Lock()
	code = http.StatusInternalServerError
	mu.Unlock()
	err = specs[1].Job.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "500") {
		t.Fatalf("500 gave %v, want an error naming the status", err)
	}
	if strings.Contains(err.Error(), "hidden") {
		t.Fatalf("error leaks the query string: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	host := strings.TrimPrefix(srv.URL, "http://")
	want := []string{"POST /hook abc billing.internal", "GET /ping  " + host, "GET /ping  " + host}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("server saw %q, want %q", got, want)
	}
}

// A database cannot fence an HTTP call: the job sends its fencing token and
// run id, and configured headers cannot forge them.
func TestHTTPJobSendsFencingToken(t *testing.T) {
	t.Parallel()
	got := make(chan http.Header, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
	}))
	defer srv.Close()
	j := &HTTPJob{JobName: "ping", Method: http.MethodPost, URL: srv.URL, Client: srv.Client(),
		Headers: map[string]string{HeaderFencingToken: "999999999999999999"}}
	ctx, lease, _ := runContext(t, inProcess(), "ping")
	if err := j.Run(ctx); err != nil {
		t.Fatal(err)
	}
	h := <-got
	if want := strconv.FormatInt(lease.Token(), 10); h.Get("Worker-Fencing-Token") != want || len(h.Values("Worker-Fencing-Token")) != 1 {
		t.Errorf("Worker-Fencing-Token = %q, want %s once", h.Values("Worker-Fencing-Token"), want)
	}
	if h.Get("Worker-Run-Id") != "run-ping" {
		t.Errorf("Worker-Run-Id = %q, want run-ping", h.Get("Worker-Run-Id"))
	}
}

func TestHTTPJobHonoursContext(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}))
	defer srv.Close()
	j := &HTTPJob{JobName: "slow", Method: http.MethodGet, URL: srv.URL, Client: srv.Client()}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := j.Run(ctx); err == nil {
		t.Fatal("a call past its deadline succeeded")
	}
}

func TestSQLJobRunsInOneTransaction(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE t (token bigint, run_id text)"); err != nil {
		t.Fatal(err)
	}
	ok := &SQLJob{JobName: "ok", Pool: db.Pool, SQL: `
INSERT INTO t VALUES (current_setting('worker.fencing_token')::bigint, current_setting('worker.run_id'));
INSERT INTO t VALUES (0, 'second statement');`}
	locker := postgresLocker(t, db)
	okCtx, okLease, _ := runContext(t, locker, "ok")
	if err := ok.Run(okCtx); err != nil {
		t.Fatal(err)
	}
	bad := &SQLJob{JobName: "bad", Pool: db.Pool, SQL: `INSERT INTO t VALUES (7, 'rolled back'); SELECT 1/0;`}
	badCtx, _, _ := runContext(t, locker, "bad")
	if err := bad.Run(badCtx); err == nil {
		t.Fatal("division by zero succeeded")
	}
	var (
		n, token int64
		runID    string
	)
	if err := db.Pool.QueryRow(ctx, "SELECT count(*), max(token), max(run_id) FILTER (WHERE token > 0) FROM t").Scan(&n, &token, &runID); err != nil {
		t.Fatal(err)
	}
	if n != 2 || token != okLease.Token() || runID != "run-ok" {
		t.Fatalf("rows=%d max token=%d run_id=%q; want the two rows of the committed run with its token %d and run id, and nothing from the failed one",
			n, token, runID, okLease.Token())
	}
}

// docs/jobs.md: "any 2xx is success, anything else a failure". A redirect
// must not be followed to another host with the job's headers (which carry
// its credentials, e.g. X-Api-Key), nor turn a 3xx into a success.
func TestHTTPJobDoesNotFollowRedirectWithHeaders(t *testing.T) {
	var leaked atomic.Value
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaked.Store(r.Header.Get("X-Api-Key"))
	}))
	defer other.Close()
	// Another host name for the same loopback: http.Client strips only
	// Authorization and Cookie on a cross-host redirect.
	target := strings.Replace(other.URL, "127.0.0.1", "localhost", 1)
	srv := httptest.NewServer(http.RedirectHandler(target+"/elsewhere", http.StatusFound))
	defer srv.Close()
	specs, err := FromDefinitions([]jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: srv.URL,
		Headers: map[string]string{"X-Api-Key": "s3cret"}}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = specs[0].Job.Run(context.Background())
	if v, _ := leaked.Load().(string); v != "" {
		t.Errorf("the job's X-Api-Key header reached the redirect target %s", target)
	}
	if err == nil {
		t.Errorf("a 302 counted as success")
	}
}
