package startup_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// The flood's bounds, from the issue: peak memory, and the number of
// connections a flood opens at once.
const (
	floodConns      = 5000
	floodPeakRSSMax = 150 << 20
)

// plainWorkerBin is the worker built without the race detector, whose
// memory is the production binary's (the race runtime takes several times
// more).
var plainWorkerBin = sync.OnceValues(func() (string, error) {
	bin := filepath.Join(filepath.Dir(workerBin), "worker-plain")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/worker-dev/worker/cmd/worker").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building the worker: %v\n%s", err, out)
	}
	return bin, nil
})

// Under 5,000 concurrent /metrics requests, and under 5,000 request heads
// that never end, the ops server keeps its peak memory under 150 MB and
// answers every /livez; afterwards its goroutines and heap come back to
// their baseline, and the stalled connections are closed by the server.
func TestOpsServerStaysBoundedUnderFloods(t *testing.T) {
	t.Parallel()
	bin, err := plainWorkerBin()
	if err != nil {
		t.Fatal(err)
	}
	// Its bounds are the worker's under a flood, not under the suite's
	// other tests: with the cores taken by them, the flood's connections
	// outpace the goroutines that close them.
	pgtest.Alone(t)
	db := pgtest.New(t)
	w := startBinary(t, bin, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false"})
	w.waitReady(t, 30*time.Second)
	baseGoroutines, baseHeap := w.metric(t, "go_goroutines"), w.metric(t, "go_memstats_heap_inuse_bytes")

	flood(t, w, "concurrent /metrics", func(conn net.Conn) bool {
		fmt.Fprintf(conn, "GET /metrics HTTP/1.1\r\nHost: ops\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			// Beyond the connection cap the server may close a connection
			// before reading its request; only a hang is wrong.
			return closedByServer(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		// 200, or 503 beyond the concurrent scrapes allowed.
		return resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusServiceUnavailable
	})
	w.waitBaseline(t, baseGoroutines, baseHeap)

	flood(t, w, "stalled request heads", func(conn net.Conn) bool {
		fmt.Fprintf(conn, "GET /metrics HTTP/1.1\r\nHost: ops\r\n")
		// The server must close the connection; the deadline is only the
		// test's bound.
		_, err := io.Copy(io.Discard, conn)
		return err == nil || closedByServer(err)
	})
	w.waitBaseline(t, baseGoroutines, baseHeap)
}

// closedByServer reports an end of the connection that the server caused:
// EOF, or a reset when the request was still unread.
func closedByServer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// flood opens floodConns connections at once, each running one exchange
// (which reports whether the server behaved), while /livez is probed on
// fresh connections from another process; every probe must be answered
// and the peak memory stay under floodPeakRSSMax.
func flood(t *testing.T, w *proc, name string, exchange func(net.Conn) bool) {
	t.Helper()
	prober := startLivezProber(t, w.addr)
	var wg sync.WaitGroup
	var misbehaved atomic.Int64
	deadline := time.Now().Add(60 * time.Second)
	for range floodConns {
		wg.Go(func() {
			conn, err := net.DialTimeout("tcp", w.addr, 30*time.Second)
			if err != nil {
				misbehaved.Add(1)
				return
			}
			defer conn.Close()
			_ = conn.SetDeadline(deadline)
			if !exchange(conn) {
				misbehaved.Add(1)
			}
		})
	}
	wg.Wait()
	probes, failed, worst := prober.stop(t)

	peak := peakRSS(t, w)
	t.Logf("%d %s: peak RSS %d MB; /livez: %d probes, worst %s", floodConns, name, peak>>20, probes, worst.Round(time.Millisecond))
	if n := misbehaved.Load(); n != 0 {
		t.Errorf("%s: %d of %d connections neither answered nor closed by the server", name, n, floodConns)
	}
	if peak > floodPeakRSSMax {
		t.Errorf("%s: peak RSS %d MB, want at most %d MB", name, peak>>20, floodPeakRSSMax>>20)
	}
	if probes == 0 || len(failed) != 0 {
		t.Errorf("%s: %d of %d /livez probes failed: %s", name, len(failed), probes, strings.Join(failed, "; "))
	}
}

// peakRSS is the worker's VmHWM.
func peakRSS(t *testing.T, w *proc) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", w.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, _ := strings.Cut(string(b), "VmHWM:")
	kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.SplitN(rest, "\n", 2)[0], "kB")), 10, 64)
	if err != nil {
		t.Fatalf("VmHWM in /proc/%d/status: %v", w.cmd.Process.Pid, err)
	}
	return kb << 10
}

// metric reads one unlabelled series from the worker's /metrics.
func (p *proc) metric(t *testing.T, name string) float64 {
	t.Helper()
	code, body := p.get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics = %d", code)
	}
	for line := range strings.SplitSeq(body, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("/metrics has no %s", name)
	return 0
}

// waitBaseline waits for the flood's goroutines to end and its heap to be
// collected: the server keeps nothing of a flood. The wait covers the
// runtime's forced collection every two minutes: an idle worker may not
// collect before. The heap's margin is for buffers the runtime pools
// until a second collection.
func (p *proc) waitBaseline(t *testing.T, goroutines, heap float64) {
	t.Helper()
	start := time.Now()
	testkit.Eventually(t, 150*time.Second, "goroutines and heap back near their baseline", func() bool {
		return p.metric(t, "go_goroutines") <= goroutines+10 && p.metric(t, "go_memstats_heap_inuse_bytes") <= heap+32<<20
	})
	t.Logf("after %s: %.0f goroutines (baseline %.0f), heap in use %.0f MB (baseline %.0f MB)", time.Since(start).Round(time.Second),
		p.metric(t, "go_goroutines"), goroutines, p.metric(t, "go_memstats_heap_inuse_bytes")/(1<<20), heap/(1<<20))
}

// livezProberEnv makes the test binary a /livez prober at the address it
// holds. The prober is its own process, as the kubelet is: in this one,
// the flood's thousands of goroutines would delay the probe's request past
// the server's grace for a silent connection, which sheds it rightly.
const livezProberEnv = "WORKER_TEST_LIVEZ_PROBER"

// livezProber is a running prober process.
type livezProber struct {
	cmd   *exec.Cmd
	stdin io.Closer
	lines chan string
}

// startLivezProber starts probing addr's /livez every 100 ms, each on a
// new connection.
func startLivezProber(t *testing.T, addr string) *livezProber {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), livezProberEnv+"="+addr)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &livezProber{cmd: cmd, stdin: stdin, lines: make(chan string)}
	go func() {
		defer close(p.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
	}()
	return p
}

// stop ends the prober and returns how many probes it made, the failed
// ones' errors and the slowest answer.
func (p *livezProber) stop(t *testing.T) (probes int, failed []string, worst time.Duration) {
	t.Helper()
	p.stdin.Close()
	for line := range p.lines {
		took, result, _ := strings.Cut(line, " ")
		d, err := time.ParseDuration(took)
		if err != nil {
			t.Fatalf("prober printed %q", line)
		}
		probes++
		worst = max(worst, d)
		if result != "ok" {
			failed = append(failed, result)
		}
	}
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("prober: %v", err)
	}
	return probes, failed, worst
}

// runLivezProber is the prober process: until its stdin closes, it prints
// one line per probe, its duration and "ok" or the failure.
func runLivezProber(addr string) {
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	c := http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	for {
		select {
		case <-stop:
			return
		case <-time.After(100 * time.Millisecond):
		}
		start := time.Now()
		resp, err := c.Get("http://" + addr + "/livez")
		result := "ok"
		switch {
		case err != nil:
			result = err.Error()
		case resp.StatusCode != http.StatusOK:
			result = resp.Status
		}
		if err == nil {
			resp.Body.Close()
		}
		fmt.Printf("%s %s\n", time.Since(start), result)
	}
}
