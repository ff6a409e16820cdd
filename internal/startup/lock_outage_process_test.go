package startup_test

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// privateRedis is a redis-server of the test's own, without persistence,
// on a port it can be restarted on.
type privateRedis struct {
	t    *testing.T
	addr string
	dir  string
	cmd  *exec.Cmd
}

func startPrivateRedis(t *testing.T) *privateRedis {
	t.Helper()
	r := &privateRedis{t: t, addr: freeAddr(t), dir: t.TempDir()}
	r.start()
	t.Cleanup(r.kill)
	return r
}

func (r *privateRedis) start() {
	r.t.Helper()
	_, port, _ := net.SplitHostPort(r.addr)
	r.cmd = exec.Command("redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", r.dir, "--logfile", filepath.Join(r.dir, "redis.log"))
	if err := r.cmd.Start(); err != nil {
		r.t.Fatalf("redis-server (scripts/services.sh ensure_redis installs it): %v", err)
	}
	testkit.Eventually(r.t, 10*time.Second, "the private redis-server to listen", func() bool {
		c, err := net.Dial("tcp", r.addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
}

// kill ends the server at once, as a crash or a lost node would.
func (r *privateRedis) kill() {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Kill()
		_ = r.cmd.Wait()
		r.cmd = nil
	}
}

// A Redis outage longer than a lease ttl is loud, once: within the ttl
// and a bound, /readyz says not ready (a rollout stops),
// lock_provider_up{provider="redis"} reads 0, and one ERROR line with
// error.code LOCK_PROVIDER_UNAVAILABLE says so; each job attempt that
// fails meanwhile logs a WARN with that code, never an empty one. When
// Redis returns on the same address, empty (a restart without
// persistence), the replica recovers by itself: ready, the gauge at 1, one
// INFO line, and its job runs again.
func TestLockProviderOutageIsLoudAndRecovers(t *testing.T) {
	t.Parallel()
	rds := startPrivateRedis(t)
	db := pgtest.New(t)
	cfg := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(cfg, []byte("jobs:\n  - name: tick\n    kind: sql\n    delay: 200ms\n    sql: SELECT 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	const ttl = 2 * time.Second
	p := startWorker(t, append([]string{
		"APP_CONFIG_FILE=" + cfg, "APP_DATABASE_URL=" + db.URL, "APP_MULTI_INSTANCE_ENABLED=true",
		"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=redis://" + rds.addr + "/0", "APP_LOCK_LEASE_TTL=" + ttl.String(),
	}, replicaOnly...))
	p.waitReady(t, 60*time.Second)
	const up = `lock_provider_up{provider="redis"}`
	if v := metricLine(p, up); v != "1" {
		t.Fatalf("%s = %q before the outage, want 1", up, v)
	}
	successes := func() string { return metricLine(p, `job_runs_total{job_name="tick",outcome="success"}`) }
	testkit.Eventually(t, 30*time.Second, "the tick job to run", func() bool { return successes() != "" && successes() != "0" })

	rds.kill()
	killed := time.Now()
	// The ttl, then the ping period and the readiness cache, with room
	// for a loaded machine.
	const bound = 10 * time.Second
	testkit.Eventually(t, ttl+bound, "/readyz to say the lock provider is unreachable", func() bool {
		code, body := p.get("/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "lock provider redis unreachable")
	})
	notReady := time.Since(killed)
	t.Logf("not ready %s after Redis was killed (lease ttl %s)", notReady.Round(time.Millisecond), ttl)
	// The outage is timed from the last ping that answered, up to a ping
	// period (ttl/10) before the kill: earlier than that is a blip taken
	// for an outage.
	if notReady < ttl-ttl/10 {
		t.Errorf("not ready %s after the kill, before a lease ttl (%s, less a ping period) had passed", notReady, ttl)
	}
	if v, ready := metricLine(p, up), metricLine(p, "worker_ready"); v != "0" || ready != "0" {
		t.Errorf("%s = %q and worker_ready = %q during the outage, want 0 and 0", up, v, ready)
	}
	// The job keeps trying meanwhile, every second: its failures are
	// coded, the first a WARN, the next ones DEBUG.
	failed := func(level string) int {
		n := 0
		for _, l := range p.out.Lines(t, "job lease not acquired; skipping run") {
			if l["error.code"] == "LOCK_PROVIDER_UNAVAILABLE" && l["job"] == "tick" && l["level"] == level {
				n++
			}
		}
		return n
	}
	testkit.Eventually(t, bound, "the tick job to fail again on the store", func() bool { return failed("DEBUG") > 0 })
	if n := failed("WARN"); n != 1 {
		t.Errorf("%d WARN lines for the tick job's failed attempts, want 1 (the first)", n)
	}
	ranBefore := successes()

	rds.start()
	back := time.Now()
	p.waitReady(t, bound)
	t.Logf("ready again %s after Redis returned", time.Since(back).Round(time.Millisecond))
	if v := metricLine(p, up); v != "1" {
		t.Errorf("%s = %q after the outage, want 1", up, v)
	}
	testkit.Eventually(t, bound, "the tick job to run again", func() bool { return successes() != ranBefore })

	errs := p.out.Lines(t, "lock provider unreachable for longer than the lease ttl; no job runs until it answers")
	if len(errs) != 1 || errs[0]["level"] != "ERROR" || errs[0]["error.code"] != "LOCK_PROVIDER_UNAVAILABLE" || errs[0]["provider"] != "redis" {
		t.Errorf("outage lines %v; want one ERROR, with error.code LOCK_PROVIDER_UNAVAILABLE and provider redis", errs)
	}
	if n := len(p.out.Lines(t, "lock provider reachable again; jobs run again")); n != 1 {
		t.Errorf("%d INFO lines for the recovery, want 1", n)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 30*time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM, want 0", code)
	}
}
