package outbox

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	osexec "os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/valyala/fasthttp"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// The harness of the relay benchmarks: a backlog copied back before every
// phase, the plain-SQL ceiling, the real worker binary as the relay, a
// webhook receiver, and CPU accounting for the database and the worker.

var benchRounds = flag.Int("rounds", 3, "relay benchmarks: rounds (phase order rotates between rounds)")

// loadBacklog inserts n producer-shaped events (~200-byte JSON payloads)
// over aggs aggregates with one INSERT ... SELECT. The rows go through the
// real insert trigger, so they are exactly what producers write. The
// payload's seq follows insertion order, so a receiver can check
// per-aggregate order.
func loadBacklog(tb testing.TB, pool *pgxpool.Pool, n, aggs int) {
	tb.Helper()
	_, err := pool.Exec(context.Background(), `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'order', 'order-' || (hashint4(g) & 2147483647) % $2, 'order.updated',
       jsonb_build_object('order_id', 'order-' || g, 'seq', g, 'customer', 'customer-' || g % 977,
                          'status', 'PAID', 'amount_cents', g * 37 % 100000, 'currency', 'EUR',
                          'note', repeat('x', 80)),
       jsonb_build_object('traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01')
FROM generate_series(1, $1) g`, n, aggs)
	if err != nil {
		tb.Fatal(err)
	}
}

// saveBacklog moves the loaded events (envelopes, and delivery rows in
// table_delivery) into table, so every phase can start from exactly the
// same rows without paying for the trigger path again.
func saveBacklog(tb testing.TB, pool *pgxpool.Pool, table string) {
	tb.Helper()
	exec(tb, pool, "CREATE TABLE "+table+" AS SELECT * FROM outbox_event")
	exec(tb, pool, "CREATE TABLE "+table+"_delivery AS SELECT * FROM outbox_delivery")
	exec(tb, pool, "TRUNCATE outbox_event, outbox_delivery")
}

// restoreBacklog replaces the outbox's contents with a saved backlog, then
// vacuums and checkpoints, so every phase starts alike. The user triggers
// are off while copying: the rows already went through them once, and the
// copy keeps their ids and event_ids. It also starts counting publishes
// afresh (trackPublished).
func restoreBacklog(tb testing.TB, pool *pgxpool.Pool, table string) {
	tb.Helper()
	for _, q := range []string{
		trackPublishedSQL,
		"TRUNCATE outbox_event, outbox_delivery, bench_published",
		"ALTER TABLE outbox_event DISABLE TRIGGER USER",
		"INSERT INTO outbox_event SELECT * FROM " + table,
		"ALTER TABLE outbox_event ENABLE TRIGGER USER",
		"INSERT INTO outbox_delivery SELECT * FROM " + table + "_delivery",
		"VACUUM ANALYZE outbox_event, outbox_delivery",
		"CHECKPOINT",
	} {
		exec(tb, pool, q)
	}
}

// trackPublishedSQL records, per statement that deletes delivery rows (a
// batch marked published, or completed), when it ran and how many rows it
// deleted: a published event leaves no row to time it by. One small
// insert per batch of hundreds.
const trackPublishedSQL = `
CREATE TABLE IF NOT EXISTS bench_published (at timestamptz NOT NULL, n bigint NOT NULL);
CREATE OR REPLACE FUNCTION bench_published() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO bench_published SELECT clock_timestamp(), count(*) FROM gone HAVING count(*) > 0;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER bench_published AFTER DELETE ON outbox_delivery
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION bench_published()`

// drainResult is one drained backlog: its rate from the database's own
// timestamps, and the CPU it cost.
type drainResult struct {
	events    int
	rate      float64       // events ÷ (last published_at − first)
	dbCPU     time.Duration // server processes of the drainer's sessions
	clientCPU time.Duration // the relay processes, or this process for the ceiling
}

// publishedSpan reads how many events were published since the backlog
// was restored, and the rate between the first and the last publishing
// statement.
func publishedSpan(tb testing.TB, pool *pgxpool.Pool) (int, float64) {
	tb.Helper()
	var n int
	var secs float64
	err := pool.QueryRow(context.Background(), `
SELECT coalesce(sum(n), 0), coalesce(extract(epoch FROM max(at) - min(at)), 0)::float8
FROM bench_published`).Scan(&n, &secs)
	if err != nil {
		tb.Fatal(err)
	}
	if secs <= 0 {
		return n, 0
	}
	return n, float64(n) / secs
}

// benchPool opens a pool whose sessions carry appName, so serverCPU can
// find their server processes.
func benchPool(tb testing.TB, db *pgtest.DB, appName string, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		tb.Fatal(err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return pool
}

// serverCPU sums the CPU time (user+system) of the server processes of the
// sessions whose application_name starts with appName. Read it while the
// sessions are still open.
func serverCPU(tb testing.TB, db *pgtest.DB, appName string) time.Duration {
	tb.Helper()
	rows, err := db.Pool.Query(context.Background(),
		"SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND starts_with(application_name, $1)", appName)
	if err != nil {
		tb.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		tb.Fatal(err)
	}
	var total time.Duration
	for _, pid := range pids {
		cpu, err := testkit.ProcessCPU(int(pid))
		if err != nil {
			tb.Fatalf("server CPU needs the database on this machine: %v", err)
		}
		total += cpu
	}
	return total
}

// workerBin is the worker binary built for the running benchmark.
var workerBin struct {
	sync.Mutex
	path string
}

// workerBinary builds cmd/worker into a directory removed with the
// benchmark, without the race detector: the benchmarks measure the binary
// as it ships. Later calls reuse it while it exists.
func workerBinary(tb testing.TB) string {
	tb.Helper()
	workerBin.Lock()
	defer workerBin.Unlock()
	if workerBin.path != "" {
		if _, err := os.Stat(workerBin.path); err == nil {
			return workerBin.path
		}
	}
	path := filepath.Join(tb.TempDir(), "worker")
	if out, err := osexec.Command("go", "build", "-o", path, "github.com/worker-dev/worker/cmd/worker").CombinedOutput(); err != nil {
		tb.Fatalf("build worker: %v\n%s", err, out)
	}
	workerBin.path = path
	return path
}

// workerProc is one running worker process.
type workerProc struct {
	cmd  *osexec.Cmd
	addr string // ops HTTP address
	errs testkit.LogBuffer
	done chan struct{}
}

// startWorkerProc runs the worker binary against db with a clean
// environment plus env. Its stdout (the log sink and the process's own
// logs) goes to stdout; nil discards it.
func startWorkerProc(tb testing.TB, db *pgtest.DB, instance string, stdout io.Writer, env ...string) *workerProc {
	tb.Helper()
	cfgFile := filepath.Join(tb.TempDir(), "empty.yaml")
	if err := os.WriteFile(cfgFile, []byte("{}\n"), 0o600); err != nil {
		tb.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &workerProc{addr: l.Addr().String(), done: make(chan struct{})}
	l.Close()
	p.cmd = osexec.Command(workerBinary(tb))
	p.cmd.Env = append([]string{
		"PATH=" + os.Getenv("PATH"),
		"APP_CONFIG_FILE=" + cfgFile,
		"APP_HTTP_ADDR=" + p.addr,
		"APP_DATABASE_URL=" + db.URL,
		"APP_INSTANCE_ID=" + instance, // sessions are named "worker <instance>"
	}, env...)
	p.cmd.Stdout = stdout
	p.cmd.Stderr = &p.errs
	if err := p.cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	return p
}

// waitReady polls /readyz until the worker answers 200.
func (p *workerProc) waitReady(tb testing.TB) {
	tb.Helper()
	c := http.Client{Timeout: time.Second}
	testkit.Eventually(tb, 30*time.Second, "worker ready", func() bool {
		select {
		case <-p.done:
			tb.Fatalf("worker exited before ready: %s", p.errs.String())
		default:
		}
		resp, err := c.Get("http://" + p.addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// stop sends SIGTERM, waits for the exit and returns the CPU time the
// process used over its life.
func (p *workerProc) stop(tb testing.TB) time.Duration {
	tb.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		tb.Fatalf("worker did not stop within 30s: %s", p.errs.String())
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		tb.Fatalf("worker exited %d: %s", code, p.errs.String())
	}
	return p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime()
}

// peakRSS is the most resident memory the running process has had so far,
// in bytes. Not the exit status's Maxrss: a child started from this
// process inherits this process's peak at exec, which an in-process
// broker makes the larger one.
func (p *workerProc) peakRSS(tb testing.TB) int64 {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		tb.Fatalf("worker peak memory: %v", err)
	}
	_, rest, _ := strings.Cut(string(b), "VmHWM:")
	var kib int64
	if _, err := fmt.Sscan(rest, &kib); err != nil {
		tb.Fatalf("worker peak memory: VmHWM in /proc/%d/status: %v", p.cmd.Process.Pid, err)
	}
	return kib << 10
}

// idleWorkerCPU is what a worker process costs to start, become ready and
// stop with nothing to publish. It is taken off each relay process's CPU.
func idleWorkerCPU(tb testing.TB, db *pgtest.DB) time.Duration {
	tb.Helper()
	var samples []time.Duration
	for range 3 {
		p := startWorkerProc(tb, db, "bench-idle", nil)
		p.waitReady(tb)
		samples = append(samples, p.stop(tb))
	}
	slices.Sort(samples)
	return samples[1]
}

// receiver is a local webhook endpoint. It answers 204 after delay,
// tells arrived (if not nil) when each request came in, and counts events
// that arrive out of their aggregate's order (by the payload's seq, which
// follows insertion order). Requests for the aggregate hang (if not
// empty) get no answer until unhang is closed; the sender gives up on
// them by its own timeout.
//
// It shares the 2 cores with the worker and the database, yet it is not
// what the benchmarks measure: a real receiver runs elsewhere. So it is a
// fasthttp server, which serves a request for much less CPU than net/http
// (no goroutine, header map or body reader per request).
type receiver struct {
	url     string
	srv     *fasthttp.Server
	delay   time.Duration
	hang    string
	unhang  chan struct{}
	arrived func(eventID string, at time.Time)

	mu       sync.Mutex
	lastSeq  map[string]int64 // by ce-subject
	disorder int
	hung     int // requests left without an answer
}

func newReceiver(delay time.Duration, hang string, arrived func(string, time.Time)) *receiver {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(fmt.Sprintf("receiver: %v", err))
	}
	r := &receiver{url: "http://" + l.Addr().String(), delay: delay, hang: hang, unhang: make(chan struct{}), arrived: arrived, lastSeq: map[string]int64{}}
	r.srv = &fasthttp.Server{Handler: r.serve}
	go func() { _ = r.srv.Serve(l) }()
	return r
}

// close answers the hung requests and stops the server.
func (r *receiver) close() {
	close(r.unhang)
	_ = r.srv.Shutdown()
}

func (r *receiver) serve(ctx *fasthttp.RequestCtx) {
	var now time.Time
	if r.arrived != nil {
		now = time.Now()
	}
	agg := ctx.Request.Header.Peek("Ce-Subject")
	if r.hang != "" && string(agg) == r.hang {
		r.mu.Lock()
		r.hung++
		r.mu.Unlock()
		<-r.unhang
		return
	}
	seq, hasSeq := payloadSeq(ctx.PostBody())
	if r.arrived != nil {
		r.arrived(string(ctx.Request.Header.Peek("Ce-Id")), now)
	}
	r.mu.Lock()
	if hasSeq {
		if seq <= r.lastSeq[string(agg)] {
			r.disorder++
		}
		r.lastSeq[string(agg)] = seq
	}
	r.mu.Unlock()
	if r.delay > 0 {
		time.Sleep(r.delay) // the receiver's answer time under test
	}
	ctx.SetStatusCode(fasthttp.StatusNoContent)
}

// payloadSeq finds "seq": N in a payload as PostgreSQL prints jsonb.
func payloadSeq(body []byte) (int64, bool) {
	_, rest, ok := bytes.Cut(body, []byte(`"seq": `))
	if !ok {
		return 0, false
	}
	end := bytes.IndexAny(rest, ",}")
	if end < 0 {
		return 0, false
	}
	n, err := strconv.ParseInt(string(rest[:end]), 10, 64)
	return n, err == nil
}

func (r *receiver) stats() (disorder, hung int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.disorder, r.hung
}

// waitDrained polls until no event is unfinished.
func waitDrained(tb testing.TB, pool *pgxpool.Pool, within time.Duration) {
	tb.Helper()
	deadline := time.Now().Add(within)
	for {
		var left bool
		err := pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM outbox_delivery WHERE `+live+`)`).Scan(&left)
		if err != nil {
			tb.Fatal(err)
		}
		if !left {
			return
		}
		if time.Now().After(deadline) {
			n, _ := publishedSpan(tb, pool)
			tb.Fatalf("backlog not drained within %s (%d published)", within, n)
		}
		time.Sleep(100 * time.Millisecond) // a poll interval, not synchronisation: nothing signals the end of a drain
	}
}

// spread is min / median / max of a sample.
type spread struct{ min, med, max float64 }

func spreadOf(xs []float64) spread {
	if len(xs) == 0 {
		return spread{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return spread{s[0], med, s[len(s)-1]}
}

// machineConditions describes the machine and the database for the
// printed report.
func machineConditions(tb testing.TB, pool *pgxpool.Pool) string {
	tb.Helper()
	var version, fsync, autovacuum, syncCommit string
	err := pool.QueryRow(context.Background(), `SELECT current_setting('server_version'), current_setting('fsync'),
       current_setting('autovacuum'), current_setting('synchronous_commit')`).Scan(&version, &fsync, &autovacuum, &syncCommit)
	if err != nil {
		tb.Fatal(err)
	}
	load, _ := os.ReadFile("/proc/loadavg")
	return fmt.Sprintf("cpus %d, load %s, PostgreSQL %s (fsync %s, synchronous_commit %s, autovacuum %s)",
		runtime.NumCPU(), strings.Join(strings.Fields(string(load))[:3], " "), version, fsync, syncCommit, autovacuum)
}
