package startup_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/startup"
	"github.com/worker-dev/worker/internal/testkit"
)

// These tests run the real binary, built once for the package.
var workerBin string

func TestMain(m *testing.M) {
	if addr := os.Getenv(livezProberEnv); addr != "" {
		runLivezProber(addr)
		return
	}
	if os.Getenv(goInboxWorkerEnv) != "" {
		os.Exit(runGoInboxWorker())
	}
	dir, err := os.MkdirTemp("", "worker-bin-")
	if err != nil {
		panic(err)
	}
	workerBin = filepath.Join(dir, "worker")
	build := exec.Command("go", "build", "-race", "-o", workerBin, "github.com/worker-dev/worker/cmd/worker")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building worker:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proc is one running worker process.
type proc struct {
	cmd    *exec.Cmd
	addr   string // ops HTTP address
	out    testkit.LogBuffer
	done   chan struct{}
	exitAt time.Time
}

func freeAddr(t *testing.T) string {
	t.Helper()
	// A port the kernel handed out for :0 is an ephemeral one: between
	// its close here and the worker's bind, an outgoing connection of any
	// process may take it (bind: address already in use, exit 71). Ports
	// below the ephemeral range (32768 and up) are never handed out so;
	// this process takes each at most once.
	for range 2000 {
		port := 20000 + int(nextPort.Add(1))%12000
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		l.Close()
		return l.Addr().String()
	}
	t.Fatal("no free port in 20000-31999")
	return ""
}

// nextPort starts each test process at its own place in freeAddr's range.
var nextPort = func() *atomic.Int64 {
	var n atomic.Int64
	n.Store(rand.Int64N(12000))
	return &n
}()

// workerConns is the most connections a worker process started with env
// and args holds (Config.MaxDBConns, or a command's pool), counted in the
// suite's share of the server; 0 when its configuration does not load: it
// exits before it connects.
func workerConns(env []string, args []string) int {
	path := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "APP_CONFIG_FILE="); ok {
			path = v // the last one wins, as in the process
		}
	}
	cfg, err := startup.LoadConfig(path, env)
	switch {
	case err != nil:
		return 0
	case isCommand(args):
		return cfg.Database.MaxConns // an operator command opens its pool only
	}
	return cfg.MaxDBConns()
}

// isCommand reports whether args name an operator command rather than run.
func isCommand(args []string) bool {
	return len(args) > 0 && args[0] != "run" && !strings.HasPrefix(args[0], "-")
}

// replicaOnly runs a replica of the cluster tests with jobs only, on the
// smallest pool: with leases, replicaConns connections each, so that three
// and the test's pool fit the suite's share of the server (pgtest).
var replicaOnly = []string{"APP_TASKS_ENABLED=false", "APP_OUTBOX_ENABLED=false", "APP_DATABASE_MAX_CONNS=2"}

const replicaConns = 6 // the pool of 2, the readiness probe's, the lease pool of 2 and its listener

// usesTestDatabase reports whether env points the worker at a test's own
// database: the exit-code tests start workers that never connect.
func usesTestDatabase(env []string) bool {
	for _, kv := range env {
		if strings.HasPrefix(kv, "APP_DATABASE_URL=") && strings.Contains(kv, "/worker_test_") {
			return true
		}
	}
	return false
}

// startWorker runs the binary with a clean environment plus env. The config
// file is an empty one unless env names APP_CONFIG_FILE.
func startWorker(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	return startBinary(t, workerBin, env, args...)
}

// startBinary is startWorker with another build of the worker.
func startBinary(t *testing.T, bin string, env []string, args ...string) *proc {
	t.Helper()
	empty := filepath.Join(t.TempDir(), "empty.yaml")
	if err := os.WriteFile(empty, []byte("{}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	counted := usesTestDatabase(env)
	if counted {
		// A smaller pool than the default 10, so the suite fits its share
		// of the server (an operator command uses a connection or two);
		// env can still set another.
		conns := "5"
		if isCommand(args) {
			conns = "2"
		}
		env = append([]string{"APP_DATABASE_MAX_CONNS=" + conns}, env...)
	}
	p := &proc{addr: freeAddr(t), done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append([]string{
		"PATH=" + os.Getenv("PATH"),
		"APP_CONFIG_FILE=" + empty,
		"APP_HTTP_ADDR=" + p.addr,
		"APP_LOG_LEVEL=debug",
		// The race runtime sleeps 1s at exit by default; exit timing is
		// under test here.
		"GORACE=atexit_sleep_ms=0",
	}, env...)
	release := func() {}
	if counted {
		release = pgtest.Reserve(t, workerConns(p.cmd.Env, args))
	}
	p.cmd.Stdout = &p.out
	p.cmd.Stderr = &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		_ = p.cmd.Wait()
		p.exitAt = time.Now()
		// Its sessions end with it (the server sees their sockets close),
		// so a later worker of the same test reuses its slots.
		release()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if strings.Contains(p.out.String(), "WARNING: DATA RACE") {
			t.Error("the worker process reported a data race")
		}
		// Every run of this build, whatever the test: a coded line names
		// its code, an uncoded one leaves the attribute out. (An older
		// build, as the upgrade test runs, is what it was.)
		for line := range strings.SplitSeq(p.out.String(), "\n") {
			if bin != workerBin {
				break
			}
			if strings.Contains(line, `"error.code":""`) || strings.Contains(line, `error.code=""`) {
				t.Errorf("log line with an empty error.code: %s", line)
			}
		}
		if t.Failed() {
			t.Logf("worker output:\n%s", p.out.String())
		}
	})
	return p
}

// exitCode waits up to limit for the process to exit.
func (p *proc) exitCode(t testing.TB, limit time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(limit):
		t.Fatalf("worker still running after %s", limit)
		return -1
	}
}

func (p *proc) get(path string) (int, string) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + p.addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitReady polls /readyz until 200 and returns how long it took.
func (p *proc) waitReady(t *testing.T, limit time.Duration) time.Duration {
	t.Helper()
	took, err := p.ready(limit)
	if err != nil {
		t.Fatal(err)
	}
	return took
}

// ready is waitReady for callers that handle a failed start themselves.
func (p *proc) ready(limit time.Duration) (time.Duration, error) {
	start := time.Now()
	for time.Since(start) < limit {
		select {
		case <-p.done:
			return 0, fmt.Errorf("worker exited %d before ready", p.cmd.ProcessState.ExitCode())
		default:
		}
		if code, _ := p.get("/readyz"); code == http.StatusOK {
			return time.Since(start), nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return 0, fmt.Errorf("not ready after %s", limit)
}

func TestRunBecomesReadyServesMetricsAndStopsOnSigterm(t *testing.T) {
	db := pgtest.NewEmpty(t) // migrations run at start
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL})
	took := p.waitReady(t, 15*time.Second)
	t.Logf("ready after %s (issue target: under 2s)", took)

	if code, _ := p.get("/livez"); code != http.StatusOK {
		t.Errorf("/livez = %d", code)
	}
	code, body := p.get("/metrics")
	if code != http.StatusOK || !strings.Contains(body, "go_goroutines") || !strings.Contains(body, "process_resident_memory_bytes") {
		t.Errorf("/metrics = %d without Go and process collectors", code)
	}
	if !strings.Contains(body, "\ngo_gc_gogc_percent 200\n") {
		t.Error("/metrics lacks go_gc_gogc_percent 200: without GOGC the worker runs at the Go default")
	}
	if pending, err := migrate.Pending(context.Background(), db.Pool); err != nil || pending {
		t.Errorf("migrations not applied at start: pending=%v err=%v", pending, err)
	}

	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	t.Logf("idle worker exited %s after SIGTERM (issue target: under 1s)", p.exitAt.Sub(sent))
	if !strings.Contains(p.out.String(), `"instance_id"`) {
		t.Error("log lines lack instance_id")
	}
}

func TestExitCodes(t *testing.T) {
	cases := []struct {
		name string
		env  []string
		args []string
		want int
		msg  string
	}{
		{"multi-instance without provider", []string{"APP_MULTI_INSTANCE_ENABLED=true"}, nil, 72, "APP_LOCK_PROVIDER"},
		{"multi-instance with inprocess", []string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=inprocess"}, nil, 72, "APP_LOCK_PROVIDER=postgres"},
		{"bad duration", []string{"APP_LOCK_WAIT_TIME=banana"}, nil, 78, "APP_LOCK_WAIT_TIME"},
		{"unknown flag", nil, []string{"--frobnicate"}, 64, "frobnicate"},
		{"unknown command", nil, []string{"frobnicate"}, 64, "frobnicate"},
		{"unknown subcommand flag", nil, []string{"migrate", "--now"}, 64, "--now"},
		{"dead purge without a selection", nil, []string{"outbox", "dead", "purge"}, 64, "exactly one of <event_id> or --all"},
		{"dead retry with both", nil, []string{"outbox", "dead", "retry", "--all", "0b6a3c5e-2f4d-4e61-9d9a-7c1c2f0e8b11"}, 64, "exactly one"},
		{"dead purge of a non-uuid", nil, []string{"outbox", "dead", "purge", "order-42"}, 64, "not an event_id"},
		{"dead list with limit 0", nil, []string{"outbox", "dead", "list", "--limit", "0"}, 64, "--limit 0: want at least 1"},
		{"emit with an empty aggregate type", nil, []string{"outbox", "emit", "--aggregate-type", "", "--aggregate-id", "42", "--event-type", "order.paid"}, 64, "--aggregate-type is empty"},
		{"emit with a blank event type", nil, []string{"outbox", "emit", "--aggregate-type", "order", "--aggregate-id", "42", "--event-type", " "}, 64, "--event-type is empty"},
		{"help", nil, []string{"--help"}, 0, "Usage: worker"},
		{"subcommand help", nil, []string{"migrate", "--help"}, 0, "Apply database migrations"},
		{"version", nil, []string{"version"}, 0, "worker"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, c.env, c.args...)
			if code := p.exitCode(t, 10*time.Second); code != c.want {
				t.Fatalf("exit %d, want %d", code, c.want)
			}
			if !strings.Contains(p.out.String(), c.msg) {
				t.Errorf("output does not mention %q:\n%s", c.msg, p.out.String())
			}
		})
	}
}

// The worker keeps trying for the whole connect budget and reports the time
// it really waited.
func TestUnreachableDatabaseExits69WithoutPassword(t *testing.T) {
	t.Parallel()
	const budget = 2 * time.Second
	start := time.Now()
	p := startWorker(t, []string{
		"APP_DATABASE_URL=postgres://app:hunter2-secret@127.0.0.1:1/app?sslmode=disable",
		"APP_DATABASE_CONNECT_TIMEOUT=" + budget.String(),
	})
	if code := p.exitCode(t, 15*time.Second); code != 69 {
		t.Fatalf("exit %d, want 69", code)
	}
	took := time.Since(start)
	t.Logf("gave up after %s", took)
	if took < budget {
		t.Errorf("gave up after %s, before the %s budget was spent", took, budget)
	}
	out := p.out.String()
	// docs/configuration.md: URLs in messages have their password, user and query
	// string masked.
	for _, secret := range []string{"hunter2", "app:", "user=app", "sslmode"} {
		if strings.Contains(out, secret) {
			t.Fatalf("%q printed:\n%s", secret, out)
		}
	}
	if !strings.Contains(out, "APP_DATABASE_CONNECT_TIMEOUT=2s") || !strings.Contains(out, "xxxxx@127.0.0.1:1") {
		t.Errorf("message should say what was unreachable and which knob bounds the wait:\n%s", out)
	}
	m := regexp.MustCompile(`unreachable after ([0-9.]+s)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("message does not say how long it waited:\n%s", out)
	}
	if waited, err := time.ParseDuration(m[1]); err != nil || waited < budget-100*time.Millisecond || waited > took {
		t.Errorf("reported %s; it ran for %s with a budget of %s", m[1], took, budget)
	}
}

// Refused credentials and a missing database are not an outage: the worker
// exits at once, with its own code, instead of retrying for the budget.
func TestDatabaseRefusalExitsAtOnce(t *testing.T) {
	t.Parallel()
	// Local PostgreSQL trusts 127.0.0.1, so a wrong password cannot be
	// provoked; an unknown role gets the same SQLSTATE class 28.
	admin, err := url.Parse(pgtest.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	role := *admin
	role.User = url.UserPassword("no_such_role_for_worker", "hunter2-secret")
	db := *admin
	db.Path = "/no_such_database_for_worker"
	cases := []struct {
		name, url string
		want      int
		msg       string
	}{
		{"unknown role", role.String(), 77, `authentication failed for user \"no_such_role_for_worker\"`},
		{"unknown database", db.String(), 66, `database \"no_such_database_for_worker\" does not exist; create it (createdb no_such_database_for_worker)`},
	}
	for _, c := range cases { // msg as it appears in the JSON line
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			// A budget far beyond the wait below: a retry would show.
			p := startWorker(t, []string{"APP_DATABASE_URL=" + c.url, "APP_DATABASE_CONNECT_TIMEOUT=5m"})
			if code := p.exitCode(t, 30*time.Second); code != c.want {
				t.Fatalf("exit %d, want %d", code, c.want)
			}
			out := p.out.String()
			if !strings.Contains(out, c.msg) || strings.Contains(out, "hunter2") || strings.Contains(out, "retrying") {
				t.Errorf("want %q once, no retry and no password:\n%s", c.msg, out)
			}
		})
	}
}

// A taken ops port is the system refusing a resource (71), not an internal
// error.
func TestPortInUseExits71(t *testing.T) {
	t.Parallel()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	p := startWorker(t, []string{"APP_HTTP_ADDR=" + taken.Addr().String()})
	if code := p.exitCode(t, 10*time.Second); code != 71 {
		t.Fatalf("exit %d, want 71", code)
	}
	if out := p.out.String(); !strings.Contains(out, "APP_HTTP_ADDR") || !strings.Contains(out, "address already in use") {
		t.Errorf("message should name the address and the cause:\n%s", out)
	}
}

// A fatal error is printed once, as one line in the configured log format,
// also when the configuration itself is what failed.
func TestFatalErrorIsOneLogLine(t *testing.T) {
	t.Parallel()
	textFile := configFile(t, "log:\n  format: text\n")
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { taken.Close() })
	cases := []struct {
		name string
		env  []string
		text bool
		code int
	}{
		{"config error, default format", []string{"APP_OUTBOX_BATCH_SIZE=-1"}, false, 78},
		{"config error, text from the environment", []string{"APP_OUTBOX_BATCH_SIZE=-1", "APP_LOG_FORMAT=text"}, true, 78},
		{"config error, text from the file", []string{"APP_OUTBOX_BATCH_SIZE=-1", "APP_CONFIG_FILE=" + textFile}, true, 78},
		{"config error, invalid format in the environment", []string{"APP_OUTBOX_BATCH_SIZE=-1", "APP_LOG_FORMAT=xml", "APP_CONFIG_FILE=" + textFile}, false, 78},
		{"unsafe setup", []string{"APP_MULTI_INSTANCE_ENABLED=true"}, false, 72},
		{"port in use", []string{"APP_HTTP_ADDR=" + taken.Addr().String()}, false, 71},
		{"port in use, text", []string{"APP_HTTP_ADDR=" + taken.Addr().String(), "APP_LOG_FORMAT=text"}, true, 71},
		{"database unreachable", []string{"APP_DATABASE_URL=postgres://127.0.0.1:1/x", "APP_DATABASE_CONNECT_TIMEOUT=1s", "APP_LOG_LEVEL=error"}, false, 69},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, c.env)
			if code := p.exitCode(t, 15*time.Second); code != c.code {
				t.Fatalf("exit %d, want %d", code, c.code)
			}
			out := strings.TrimSpace(p.out.String())
			if strings.Count(out, "\n") != 0 {
				t.Fatalf("want one line:\n%s", out)
			}
			if c.text {
				if !strings.HasPrefix(out, "time=") || !strings.Contains(out, "level=ERROR") || !strings.Contains(out, fmt.Sprintf("exit_code=%d", c.code)) {
					t.Errorf("want a text log line:\n%s", out)
				}
				return
			}
			var line struct {
				Level    string `json:"level"`
				Error    string `json:"error"`
				ExitCode int    `json:"exit_code"`
			}
			if err := json.Unmarshal([]byte(out), &line); err != nil || line.Level != "ERROR" || line.ExitCode != c.code || line.Error == "" {
				t.Errorf("want a JSON log line with level, error and exit_code (%v):\n%s", err, out)
			}
			if strings.Contains(out, `"instance_id":""`) {
				t.Errorf("an instance id not known yet should be left out, not empty:\n%s", out)
			}
		})
	}
}

func TestMigrateCommandIsIdempotent(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	for i := range 2 {
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL}, "migrate")
		if code := p.exitCode(t, 60*time.Second); code != 0 {
			t.Fatalf("run %d: exit %d", i, code)
		}
	}
	if pending, err := migrate.Pending(context.Background(), db.Pool); err != nil || pending {
		t.Fatalf("pending=%v err=%v", pending, err)
	}
}

// Ctrl-C on an operator command that waits for the database stops it with
// exit 1, not as an internal error.
func TestInterruptedOperatorCommandExits1(t *testing.T) {
	t.Parallel()
	p := startWorker(t, []string{"APP_DATABASE_URL=postgres://127.0.0.1:1/x", "APP_DATABASE_CONNECT_TIMEOUT=5m"}, "outbox", "stats")
	testkit.Eventually(t, 10*time.Second, "the command to wait for the database", func() bool {
		return strings.Contains(p.out.String(), "database not reachable yet")
	})
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 10*time.Second); code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	if !strings.Contains(p.out.String(), "interrupted by a signal") {
		t.Errorf("message should say it was interrupted:\n%s", p.out.String())
	}
}
