package startup_test

import (
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// healthcheck runs `worker healthcheck` against the ops server at addr and
// returns its exit code and output.
func healthcheck(t *testing.T, addr string) (int, string) {
	t.Helper()
	hc := startWorker(t, []string{"APP_HTTP_ADDR=" + addr}, "healthcheck")
	return hc.exitCode(t, 15*time.Second), hc.out.String()
}

func TestHealthcheckFollowsReadiness(t *testing.T) {
	t.Parallel()
	p := startWorker(t, []string{"APP_DATABASE_URL=" + pgtest.New(t).URL})
	p.waitReady(t, 15*time.Second)
	if code, out := healthcheck(t, p.addr); code != 0 || !strings.Contains(out, "ready") {
		t.Fatalf("against a ready worker: exit %d, want 0; output:\n%s", code, out)
	}

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("worker exit %d after SIGTERM", code)
	}
	if code, out := healthcheck(t, p.addr); code != 1 || !strings.Contains(out, "not ready") {
		t.Fatalf("against a stopped worker: exit %d, want 1; output:\n%s", code, out)
	}
}

// Running is not ready: a worker still waiting for its database answers
// /livez but not /readyz, and the health check says so.
func TestHealthcheckFailsWhileTheWorkerIsStarting(t *testing.T) {
	t.Parallel()
	p := startWorker(t, []string{"APP_DATABASE_URL=postgres://app@127.0.0.1:1/app?sslmode=disable", "APP_DATABASE_CONNECT_TIMEOUT=60s"})
	testkit.Eventually(t, 15*time.Second, "the ops server to answer /livez", func() bool {
		code, _ := p.get("/livez")
		return code == http.StatusOK
	})
	if code, out := healthcheck(t, p.addr); code != 1 || !strings.Contains(out, "503") {
		t.Fatalf("against a starting worker: exit %d, want 1 naming the 503; output:\n%s", code, out)
	}
}
