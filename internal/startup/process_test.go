package startup_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"worker/internal/migrate"
	"worker/internal/pgtest"
	"worker/internal/testkit"
)

// These tests run the real binary, built once for the package.
var workerBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "worker-bin-")
	if err != nil {
		panic(err)
	}
	workerBin = filepath.Join(dir, "worker")
	build := exec.Command("go", "build", "-race", "-o", workerBin, "worker/cmd/worker")
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
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startWorker runs the binary with a clean environment plus env. The config
// file is an empty one unless env names APP_CONFIG_FILE.
func startWorker(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	empty := filepath.Join(t.TempDir(), "empty.yaml")
	if err := os.WriteFile(empty, []byte("{}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := &proc{addr: freeAddr(t), done: make(chan struct{})}
	p.cmd = exec.Command(workerBin, args...)
	p.cmd.Env = append([]string{
		"PATH=" + os.Getenv("PATH"),
		"APP_CONFIG_FILE=" + empty,
		"APP_HTTP_ADDR=" + p.addr,
		"APP_LOG_LEVEL=debug",
		// The race runtime sleeps 1s at exit by default; exit timing is
		// under test here.
		"GORACE=atexit_sleep_ms=0",
	}, env...)
	p.cmd.Stdout = &p.out
	p.cmd.Stderr = &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		_ = p.cmd.Wait()
		p.exitAt = time.Now()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if strings.Contains(p.out.String(), "WARNING: DATA RACE") {
			t.Error("the worker process reported a data race")
		}
		if t.Failed() {
			t.Logf("worker output:\n%s", p.out.String())
		}
	})
	return p
}

// exitCode waits up to limit for the process to exit.
func (p *proc) exitCode(t *testing.T, limit time.Duration) int {
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

func TestUnreachableDatabaseExits69WithoutPassword(t *testing.T) {
	start := time.Now()
	p := startWorker(t, []string{
		"APP_DATABASE_URL=postgres://app:hunter2-secret@127.0.0.1:1/app?sslmode=disable",
		"APP_DATABASE_CONNECT_TIMEOUT=1s",
	})
	if code := p.exitCode(t, 15*time.Second); code != 69 {
		t.Fatalf("exit %d, want 69", code)
	}
	t.Logf("gave up after %s", time.Since(start))
	out := p.out.String()
	if strings.Contains(out, "hunter2") {
		t.Fatalf("password printed:\n%s", out)
	}
	if !strings.Contains(out, "APP_DATABASE_CONNECT_TIMEOUT") || !strings.Contains(out, "app:xxxxx@127.0.0.1:1") {
		t.Errorf("message should say what was unreachable and which knob bounds the wait:\n%s", out)
	}
}

func TestMigrateCommandIsIdempotent(t *testing.T) {
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
