// Command bench measures the worker binary as users run it: real worker
// processes started with the shipped configuration and APP_* variables
// only, timed from what their sink receives, beside a minimal claim + mark +
// read-back loop on the same database in the same round. scripts/bench
// builds it and the worker, and runs it; docs/performance/binary.md
// explains the phases and the figures.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

type options struct {
	worker     string
	server     string // URL of the server; the benchmark creates its database there
	dbName     string
	rounds     int
	events     int
	aggregates int
	rates      []int
	rateFor    time.Duration
	slow       []time.Duration
	slowEvents int
	phases     map[string]bool // empty: all
	out        string
	workerEnv  map[string]string // settings beyond the shipped ones
	profile    string            // a command run during each drain, given the pids
}

func main() {
	var o options
	var rates, slow, phases string
	flag.StringVar(&o.worker, "worker", "", "the worker binary")
	flag.StringVar(&o.server, "server", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "URL of a database on the PostgreSQL server to use")
	flag.StringVar(&o.dbName, "db", "bench_binary", "database the benchmark creates and drops")
	flag.IntVar(&o.rounds, "rounds", 5, "rounds; the order of the phases rotates each round")
	flag.IntVar(&o.events, "events", 100_000, "backlog of each drain")
	flag.IntVar(&o.aggregates, "aggregates", 1000, "aggregates of the drain backlog")
	flag.StringVar(&rates, "rates", "500,2000", "producer rates (events/s) of the latency phases")
	flag.DurationVar(&o.rateFor, "rate-for", 15*time.Second, "how long each latency phase produces")
	flag.StringVar(&slow, "slow", "150ms,400ms", "answer times of the slow webhook phases")
	flag.IntVar(&o.slowEvents, "slow-events", 5000, "backlog of the slow webhook phases (200 aggregates, 10 commits)")
	flag.StringVar(&phases, "phases", "", "comma-separated phases to run (default all): "+strings.Join(allPhaseNames(), ","))
	flag.StringVar(&o.out, "out", ".", "directory for bench.csv and bench.png")
	flag.StringVar(&o.profile, "profile", "", "a shell command run during each drain from the commit to the last event, and each latency phase while its producers run, then sent SIGINT; "+
		"$WORKER_PIDS and $BACKEND_PIDS are the workers' and their database backends' pids (comma-separated), $WORKER_OPS the workers' ops addresses "+
		"(host:port, comma-separated; with -worker-env APP_HTTP_PPROF=true they serve Go's profiles), $PHASE the phase, $ROUND the round")
	o.workerEnv = map[string]string{}
	flag.Func("worker-env", "an APP_* setting of every worker, KEY=VALUE (repeatable): a what-if, or a small pool for a smoke test", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok || !strings.HasPrefix(k, "APP_") {
			return fmt.Errorf("%q is not APP_KEY=VALUE", s)
		}
		o.workerEnv[k] = v
		return nil
	})
	flag.Parse()
	if o.worker == "" || o.rounds < 1 {
		log.Fatal("bench: -worker is required and -rounds must be at least 1")
	}
	for _, s := range splitList(rates) {
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			log.Fatalf("bench: -rates: %q is not a positive number", s)
		}
		o.rates = append(o.rates, n)
	}
	for _, s := range splitList(slow) {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			log.Fatalf("bench: -slow: %q is not a positive duration", s)
		}
		o.slow = append(o.slow, d)
	}
	o.phases = map[string]bool{}
	for _, p := range splitList(phases) {
		o.phases[p] = true
	}
	log.SetFlags(log.Ltime)
	if err := run(context.Background(), o); err != nil {
		log.Fatalf("bench: %v", err)
	}
}

func splitList(s string) []string {
	var out []string
	for p := range strings.SplitSeq(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// A phase is one measurement of a round.
type phase struct {
	name string
	run  func(ctx context.Context, b *bench) (result, error)
}

// result is one phase's figures in one round; zero fields were not measured.
type result struct {
	events        int
	rate          float64 // events/s, first to last delivery (drains)
	commitRate    float64 // events/s, from the backlog's commit to the last delivery
	expected      float64 // slow webhook: max_in_flight ÷ latency
	p50, p99, max float64 // latency phases, ms
	dbCPU         float64 // µs of the database backends' CPU per event
	workerCPU     float64 // µs of the workers' CPU per event
}

// The drain phases, as (processes, relays, multi-instance, sink).
type drain struct {
	procs, relays int
	multi         bool
	sink          string // log or webhook
}

func (d drain) name() string {
	n := fmt.Sprintf("%s-%dx%d", d.sink, d.procs, d.relays)
	if d.multi {
		n += "-multi"
	}
	return n
}

var drains = []drain{
	{1, 1, false, "log"}, // the default configuration
	{1, 1, true, "log"},
	{1, 1, false, "webhook"},
	{1, 1, true, "webhook"},
	{1, 2, true, "log"},
	{2, 2, true, "log"},
	{2, 1, true, "webhook"},
}

func allPhaseNames() []string {
	names := []string{"loop"}
	for _, d := range drains {
		names = append(names, d.name())
	}
	return append(names, "latency-<rate>", "slow-<ms>")
}

func (o options) phaseList() []phase {
	var ps []phase
	ps = append(ps, phase{"loop", func(ctx context.Context, b *bench) (result, error) { return b.loop(ctx) }})
	for _, d := range drains {
		ps = append(ps, phase{d.name(), func(ctx context.Context, b *bench) (result, error) { return b.drain(ctx, d) }})
	}
	for _, r := range o.rates {
		ps = append(ps, phase{fmt.Sprintf("latency-%d", r), func(ctx context.Context, b *bench) (result, error) { return b.latency(ctx, r) }})
	}
	for _, d := range o.slow {
		ps = append(ps, phase{fmt.Sprintf("slow-%d", d.Milliseconds()), func(ctx context.Context, b *bench) (result, error) { return b.slowDrain(ctx, d) }})
	}
	if len(o.phases) == 0 {
		return ps
	}
	return slices.DeleteFunc(ps, func(p phase) bool { return !o.phases[p.name] })
}

type bench struct {
	o     options
	url   string // the benchmark's database
	conn  *pgx.Conn
	hook  *receiver
	round int
}

type row struct {
	round int
	load  float64
	phase string
	result
}

func run(ctx context.Context, o options) error {
	admin, err := pgx.Connect(ctx, o.server)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+o.dbName+" WITH (FORCE)"); err != nil {
		return err
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+o.dbName); err != nil {
		return err
	}
	defer admin.Exec(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+o.dbName+" WITH (FORCE)") //nolint:errcheck

	cfg, err := pgx.ParseConfig(o.server)
	if err != nil {
		return err
	}
	cfg.Database = o.dbName
	cfg.RuntimeParams["application_name"] = "bench" // apart from the workers' sessions in pg_stat_activity
	b := &bench{o: o, url: withDatabase(o.server, o.dbName)}
	if b.conn, err = pgx.ConnectConfig(ctx, cfg); err != nil {
		return err
	}
	defer b.conn.Close(ctx)
	mig := exec.CommandContext(ctx, o.worker, "migrate")
	mig.Env = b.env(map[string]string{"APP_LOG_LEVEL": "warn"})
	if out, err := mig.CombinedOutput(); err != nil {
		return fmt.Errorf("worker migrate: %v\n%s", err, out)
	}
	if _, err := b.conn.Exec(ctx, loopTableSQL); err != nil {
		return err
	}
	if b.hook, err = startReceiver(); err != nil {
		return err
	}
	defer b.hook.close()

	phases := o.phaseList()
	var rows []row
	for round := 1; round <= o.rounds; round++ {
		for i := range phases {
			p := phases[(i+round-1)%len(phases)] // rotate the order each round
			load := loadAverage()
			log.Printf("round %d: %s (load %.2f)", round, p.name, load)
			b.round = round
			res, err := p.run(ctx, b)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round, p.name, err)
			}
			rows = append(rows, row{round, load, p.name, res})
			log.Printf("round %d: %s: %s", round, p.name, res)
		}
	}
	if err := writeCSV(o.out+"/bench.csv", rows); err != nil {
		return err
	}
	printTable(os.Stdout, o, rows)
	return plotRates(o.out+"/bench.png", rows)
}

func (r result) String() string {
	var parts []string
	if r.rate > 0 {
		parts = append(parts, fmt.Sprintf("%.0f events/s (%.0f from the commit)", r.rate, r.commitRate))
	}
	if r.expected > 0 {
		parts = append(parts, fmt.Sprintf("%.2f of max_in_flight ÷ latency", r.commitRate/r.expected))
	}
	if r.p99 > 0 {
		parts = append(parts, fmt.Sprintf("p50 %.1f ms, p99 %.1f ms, max %.1f ms", r.p50, r.p99, r.max))
	}
	if r.dbCPU > 0 || r.workerCPU > 0 {
		parts = append(parts, fmt.Sprintf("CPU/event: database %.1f µs, worker %.1f µs", r.dbCPU, r.workerCPU))
	}
	return strings.Join(parts, "; ")
}

func withDatabase(server, db string) string {
	i := strings.LastIndex(server, "/")
	q := ""
	if j := strings.Index(server, "?"); j > i {
		q = server[j:]
	}
	return server[:i+1] + db + q
}

func loadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return math.NaN()
	}
	f, _ := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	return f
}

// reset empties the outbox and settles the database, so every phase starts
// from the same state.
func (b *bench) reset(ctx context.Context) error {
	for _, q := range []string{
		"TRUNCATE outbox_event, outbox_delivery, loop_event",
		"VACUUM ANALYZE outbox_event, outbox_delivery, loop_event",
		"CHECKPOINT",
	} {
		if _, err := b.conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	return nil
}

// The minimal loop: a table with only the columns a relay reads and its
// state, two partial indexes, and one statement that claims, marks and
// returns a batch of 500, on one connection. The in-process ceiling
// benchmark (internal/outbox) uses the same table and statement.
const loopTableSQL = `
CREATE TABLE loop_event (
    id              bigint      PRIMARY KEY,
    event_id        uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type  text        COLLATE "C" NOT NULL,
    aggregate_id    text        COLLATE "C" NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    occurred_at     timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'PENDING',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz
);
CREATE INDEX loop_event_unfinished_idx ON loop_event (id)
    WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT');
CREATE INDEX loop_event_aggregate_idx ON loop_event (aggregate_type, aggregate_id, id)
    WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT')`

const loopSQL = `
UPDATE loop_event SET status = 'PUBLISHED', published_at = clock_timestamp(), attempts = attempts + 1
WHERE id IN (SELECT id FROM loop_event
             WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT') AND next_attempt_at <= now()
             ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED)
RETURNING id, event_id::text, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, attempts`

// payloadSQL makes a payload of about 200 bytes for event g.
const payloadSQL = `jsonb_build_object('order', g, 'carrier', 'DHL', 'note', repeat('x', 150))`

func (b *bench) loop(ctx context.Context) (result, error) {
	if err := b.reset(ctx); err != nil {
		return result{}, err
	}
	n := b.o.events
	if _, err := b.conn.Exec(ctx, `INSERT INTO loop_event (id, aggregate_type, aggregate_id, event_type, payload)
		SELECT g, 'order', (g % $2)::text, 'order.shipped', `+payloadSQL+` FROM generate_series(1, $1) g`, n, b.o.aggregates); err != nil {
		return result{}, err
	}
	if _, err := b.conn.Exec(ctx, "VACUUM ANALYZE loop_event"); err != nil {
		return result{}, err
	}
	c, err := pgx.Connect(ctx, b.url)
	if err != nil {
		return result{}, err
	}
	defer c.Close(ctx)
	var pid int
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return result{}, err
	}
	cpu0 := procCPU(pid)
	start := time.Now()
	done := 0
	for done < n {
		rows, err := c.Query(ctx, loopSQL)
		if err != nil {
			return result{}, err
		}
		got := 0
		for rows.Next() {
			var (
				id, attempts     int64
				eid, at, aid, et string
				payload, headers []byte
				occurred         time.Time
			)
			if err := rows.Scan(&id, &eid, &at, &aid, &et, &payload, &headers, &occurred, &attempts); err != nil {
				return result{}, err
			}
			got++
		}
		if err := rows.Err(); err != nil {
			return result{}, err
		}
		if got == 0 {
			return result{}, errors.New("loop: nothing left to claim before the backlog was done")
		}
		done += got
	}
	secs := time.Since(start).Seconds()
	return result{events: n, rate: float64(n) / secs, commitRate: float64(n) / secs,
		dbCPU: us(procCPU(pid)-cpu0) / float64(n)}, nil
}

// env is the worker's environment: this process's, without other APP_*
// variables, the benchmark's database, a free ops port, and extra.
func (b *bench) env(extra map[string]string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "APP_") {
			env = append(env, kv)
		}
	}
	env = append(env, "APP_DATABASE_URL="+b.url)
	for k, v := range b.o.workerEnv {
		env = append(env, k+"="+v)
	}
	for k, v := range extra {
		env = append(env, k+"="+v)
	}
	return env
}

// A proc is one running worker.
type proc struct {
	cmd   *exec.Cmd
	ops   string
	lines chan time.Time // arrival of each event line on stdout (log sink)
	err   io.Writer
}

// startWorkers starts n workers with extra settings, each on its own ops
// port, and returns once all of them answer /readyz and have had a second
// to start their relays.
func (b *bench) startWorkers(ctx context.Context, n int, extra map[string]string) ([]*proc, error) {
	var ps []*proc
	for range n {
		port, err := freePort()
		if err != nil {
			return ps, err
		}
		e := map[string]string{"APP_HTTP_ADDR": "127.0.0.1:" + port}
		for k, v := range extra {
			e[k] = v
		}
		cmd := exec.Command(b.o.worker)
		cmd.Env = b.env(e)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		stderr := &tailBuffer{}
		cmd.Stderr = stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return ps, err
		}
		p := &proc{cmd: cmd, ops: "127.0.0.1:" + port, lines: make(chan time.Time, 1<<20), err: stderr}
		if err := cmd.Start(); err != nil {
			return ps, err
		}
		ps = append(ps, p)
		go p.readLines(out)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for _, p := range ps {
		for !ready(p.ops) {
			if time.Now().After(deadline) || p.cmd.ProcessState != nil {
				return ps, fmt.Errorf("worker not ready on %s; its stderr ends:\n%s", p.ops, p.err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	time.Sleep(time.Second)
	return ps, nil
}

// readLines timestamps every event line the log sink prints.
func (p *proc) readLines(r io.Reader) {
	br := bufio.NewReaderSize(r, 1<<20)
	for {
		line, err := br.ReadSlice('\n')
		if len(line) > 0 && strings.HasPrefix(string(line[:min(len(line), 12)]), `{"event_id"`) {
			p.lines <- time.Now()
		}
		if err == bufio.ErrBufferFull {
			continue
		}
		if err != nil {
			close(p.lines)
			return
		}
	}
}

func stopWorkers(ps []*proc) {
	for _, p := range ps {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range ps {
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
}

func ready(addr string) bool {
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port), nil
}

func workerSettings(d drain, hookURL string) map[string]string {
	e := map[string]string{"APP_OUTBOX_RELAYS": strconv.Itoa(d.relays)}
	if d.multi {
		e["APP_MULTI_INSTANCE_ENABLED"] = "true"
		e["APP_LOCK_PROVIDER"] = "postgres"
	}
	if d.sink == "webhook" {
		e["APP_OUTBOX_SINK"] = "webhook"
		e["APP_OUTBOX_WEBHOOK_URL"] = hookURL
	}
	return e
}

// drain commits a backlog of events over aggregates at once, with the
// workers ready, and times its delivery.
func (b *bench) drain(ctx context.Context, d drain) (result, error) {
	if err := b.reset(ctx); err != nil {
		return result{}, err
	}
	b.hook.arm(0)
	ps, err := b.startWorkers(ctx, d.procs, workerSettings(d, b.hook.url))
	defer stopWorkers(ps)
	if err != nil {
		return result{}, err
	}
	n := b.o.events
	cpu := b.cpuMeter(ctx, ps)
	stopProfile := b.startProfile(d.name(), cpu, ps)
	defer stopProfile()
	if _, err := b.conn.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', (g % $2)::text, 'order.shipped', `+payloadSQL+` FROM generate_series(1, $1) g`, n, b.o.aggregates); err != nil {
		return result{}, err
	}
	committed := time.Now()
	var arrivals []time.Time
	if d.sink == "log" {
		arrivals, err = collectLines(ps, n, 5*time.Minute)
	} else {
		arrivals, err = b.hook.wait(n, 5*time.Minute)
	}
	if err != nil {
		return result{}, err
	}
	stopProfile()
	dbCPU, workerCPU := cpu.perEvent(ctx, n)
	first, last := arrivals[0], arrivals[len(arrivals)-1]
	return result{events: n,
		rate:       float64(n-1) / last.Sub(first).Seconds(),
		commitRate: float64(n) / last.Sub(committed).Seconds(),
		dbCPU:      dbCPU, workerCPU: workerCPU}, nil
}

// collectLines gathers the first n event lines of the workers' stdout.
func collectLines(ps []*proc, n int, within time.Duration) ([]time.Time, error) {
	merged := make(chan time.Time, 1<<16)
	for _, p := range ps {
		go func() {
			for t := range p.lines {
				merged <- t
			}
		}()
	}
	deadline := time.After(within)
	out := make([]time.Time, 0, n)
	for len(out) < n {
		select {
		case t := <-merged:
			out = append(out, t)
		case <-deadline:
			return nil, fmt.Errorf("%d of %d events printed in %s", len(out), n, within)
		}
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out, nil
}

// latency runs pgbench single-row producers at rate for o.rateFor against
// one default worker with the webhook sink, and takes each event's arrival
// time minus its occurred_at (the producer transaction's start).
func (b *bench) latency(ctx context.Context, rate int) (result, error) {
	if err := b.reset(ctx); err != nil {
		return result{}, err
	}
	b.hook.arm(0)
	ps, err := b.startWorkers(ctx, 1, workerSettings(drain{1, 1, false, "webhook"}, b.hook.url))
	defer stopWorkers(ps)
	if err != nil {
		return result{}, err
	}
	script, err := os.CreateTemp("", "bench-producer-*.sql")
	if err != nil {
		return result{}, err
	}
	defer os.Remove(script.Name())
	fmt.Fprintf(script, "\\set a random(1, %d)\nINSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', :a, 'order.shipped', '{\"carrier\": \"DHL\"}');\n", b.o.aggregates)
	script.Close()
	cpu := b.cpuMeter(ctx, ps)
	stopProfile := b.startProfile(fmt.Sprintf("latency-%d", rate), cpu, ps)
	defer stopProfile()
	secs := strconv.Itoa(max(1, int(b.o.rateFor.Seconds())))
	pg := exec.CommandContext(ctx, "pgbench", "-n", "-c", "4", "-j", "2", "-R", strconv.Itoa(rate), "-T", secs, "-f", script.Name(), b.url)
	if out, err := pg.CombinedOutput(); err != nil {
		return result{}, fmt.Errorf("pgbench: %v\n%s", err, out)
	}
	stopProfile()
	var n int
	if err := b.conn.QueryRow(ctx, "SELECT count(*) FROM outbox_event").Scan(&n); err != nil {
		return result{}, err
	}
	if _, err := b.hook.wait(n, time.Minute); err != nil {
		return result{}, err
	}
	dbCPU, workerCPU := cpu.perEvent(ctx, n)
	lat := b.hook.latencies()
	slices.Sort(lat)
	return result{events: n, p50: quantile(lat, 0.5), p99: quantile(lat, 0.99), max: lat[len(lat)-1],
		dbCPU: dbCPU, workerCPU: workerCPU}, nil
}

// slowDrain commits o.slowEvents events over 200 aggregates in 10
// transactions to one default worker whose webhook answers after delay,
// and compares the rate with max_in_flight ÷ delay.
func (b *bench) slowDrain(ctx context.Context, delay time.Duration) (result, error) {
	if err := b.reset(ctx); err != nil {
		return result{}, err
	}
	b.hook.arm(delay)
	ps, err := b.startWorkers(ctx, 1, workerSettings(drain{1, 1, false, "webhook"}, b.hook.url))
	defer stopWorkers(ps)
	if err != nil {
		return result{}, err
	}
	n := b.o.slowEvents
	start := time.Now()
	for i := range 10 {
		lo, hi := i*n/10+1, (i+1)*n/10
		if _, err := b.conn.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'order', (g % 200)::text, 'order.shipped', `+payloadSQL+` FROM generate_series($1::int, $2::int) g`, lo, hi); err != nil {
			return result{}, err
		}
	}
	arrivals, err := b.hook.wait(n, 10*time.Minute)
	if err != nil {
		return result{}, err
	}
	const maxInFlight = 64 // the webhook sink's default
	last := arrivals[len(arrivals)-1]
	return result{events: n,
		rate:       float64(n-1) / last.Sub(arrivals[0]).Seconds(),
		commitRate: float64(n) / last.Sub(start).Seconds(),
		expected:   maxInFlight / delay.Seconds()}, nil
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	return sorted[min(len(sorted)-1, int(math.Ceil(q*float64(len(sorted))))-1)]
}

// tailBuffer keeps the last 8 KiB written to it: a worker's stderr, shown
// when it fails.
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 8<<10 {
		t.b = t.b[len(t.b)-8<<10:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// startProfile runs o.profile, if any, and returns what stops it: SIGINT,
// as perf record and the like expect, then a wait for it to write out.
func (b *bench) startProfile(phase string, m *cpuMeter, ps []*proc) (stop func()) {
	if b.o.profile == "" {
		return func() {}
	}
	join := func(pids []int) string {
		s := make([]string, len(pids))
		for i, p := range pids {
			s[i] = strconv.Itoa(p)
		}
		return strings.Join(s, ",")
	}
	var backends []int
	for pid := range m.start {
		if !slices.Contains(m.workers, pid) {
			backends = append(backends, pid)
		}
	}
	cmd := exec.Command("sh", "-c", b.o.profile)
	ops := make([]string, len(ps))
	for i, p := range ps {
		ops[i] = p.ops
	}
	cmd.Env = append(os.Environ(), "WORKER_PIDS="+join(m.workers), "BACKEND_PIDS="+join(backends),
		"WORKER_OPS="+strings.Join(ops, ","), "PHASE="+phase, "ROUND="+strconv.Itoa(b.round))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		log.Printf("profile: %v", err)
		return func() {}
	}
	time.Sleep(200 * time.Millisecond) // let it attach
	var once sync.Once
	return func() {
		once.Do(func() {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGINT)
			_ = cmd.Wait()
		})
	}
}
