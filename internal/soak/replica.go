package main

import (
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/worker-dev/worker/internal/soak/load"
)

// replica is one worker process, started again on the same addresses.
type replica struct {
	i                  int
	bin, logPath       string
	opsAddr, inboxAddr string
	env                []string
	cmd                *exec.Cmd
	done               chan struct{}
	startedAt          time.Time
	dbPort             int

	mu    sync.Mutex
	least float64 // go_goroutines' least reading since the last floor; 0 for none
}

func newReplica(i int, bin, dir, dbURL, sinkURL string, key []byte) (*replica, error) {
	r := &replica{i: i, bin: bin, logPath: filepath.Join(dir, fmt.Sprintf("replica-%d.log", i))}
	var err error
	if r.opsAddr, err = freeAddr(); err != nil {
		return nil, err
	}
	if r.inboxAddr, err = freeAddr(); err != nil {
		return nil, err
	}
	cfg := filepath.Join(dir, fmt.Sprintf("replica-%d.yaml", i))
	if err := os.WriteFile(cfg, []byte(load.WorkerConfig(r.inboxAddr, base64.StdEncoding.EncodeToString(key))), 0o600); err != nil {
		return nil, err
	}
	m := regexp.MustCompile(`:(\d+)/`).FindStringSubmatch(dbURL)
	r.dbPort, _ = strconv.Atoi(m[1])
	r.env = []string{
		"PATH=" + os.Getenv("PATH"),
		"APP_CONFIG_FILE=" + cfg, "APP_DATABASE_URL=" + dbURL, "APP_HTTP_ADDR=" + r.opsAddr,
		"APP_INSTANCE_ID=" + fmt.Sprintf("replica-%d", i), "APP_LOG_LEVEL=info",
		"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres",
		"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + sinkURL,
		"APP_OUTBOX_PARTITION_INTERVAL=" + partitionEvery.String(), "APP_OUTBOX_RETENTION=" + retention.String(),
		"APP_INBOX_RETENTION=1m", "APP_INBOX_REAP_INTERVAL=10s",
		"APP_OUTBOX_MAX_ATTEMPTS=1000", "APP_OUTBOX_BACKOFF_BASE=100ms", "APP_OUTBOX_BACKOFF_MAX=1s",
	}
	return r, nil
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// start starts the process and waits until /readyz answers 200.
func (r *replica) start() error {
	f, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	r.cmd = exec.Command(r.bin)
	r.cmd.Env = r.env
	r.cmd.Stdout, r.cmd.Stderr = f, f
	if err := r.cmd.Start(); err != nil {
		f.Close()
		return err
	}
	r.done = make(chan struct{})
	go func() { _ = r.cmd.Wait(); f.Close(); close(r.done) }()
	r.startedAt = time.Now()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if r.exited() {
			return fmt.Errorf("replica-%d exited at start (see %s)", r.i, r.logPath)
		}
		if code, _ := r.get("/readyz"); code == http.StatusOK {
			return nil
		}
	}
	return fmt.Errorf("replica-%d not ready after 60s (see %s)", r.i, r.logPath)
}

// restart stops the process with SIGTERM, as a rollout does, and starts it.
func (r *replica) restart() error {
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(time.Minute):
		return fmt.Errorf("replica-%d still running a minute after SIGTERM", r.i)
	}
	return r.start()
}

func (r *replica) exited() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

func (r *replica) kill() {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Kill()
		<-r.done
	}
}

func (r *replica) get(path string) (int, string) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + r.opsAddr + path)
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// metric reads one unlabelled series from the ops port's /metrics.
func (r *replica) metric(name string) (float64, bool) {
	_, body := r.get("/metrics")
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseFloat(m[1], 64)
	return v, err == nil
}

// watchGoroutines reads go_goroutines every 2 s until stop, keeping the
// least reading since the last floor: goroutines come and go by the
// hundred with the work of the moment (a burst of webhooks, a batch in
// flight), and a leak raises the floor.
func (r *replica) watchGoroutines(stop <-chan struct{}) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		if v, ok := r.metric("go_goroutines"); ok {
			r.mu.Lock()
			if r.least == 0 || v < r.least {
				r.least = v
			}
			r.mu.Unlock()
		}
	}
}

// floor is the least goroutine count read since the last call.
func (r *replica) floor() float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	v := r.least
	r.least = 0
	return v
}

// dbConns counts the process's open TCP connections to the database's
// port: its pools, the readiness probe's, the leases' and the listeners',
// whatever their application_name. Linux only (/proc).
func (r *replica) dbConns() int {
	pid := r.cmd.Process.Pid
	inodes := map[string]bool{}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, fd := range fds {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if inode, ok := strings.CutPrefix(link, "socket:["); err == nil && ok {
			inodes[strings.TrimSuffix(inode, "]")] = true
		}
	}
	n := 0
	for _, table := range []string{"tcp", "tcp6"} {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			// remote address, state 01 (ESTABLISHED), inode
			if len(f) < 10 || f[3] != "01" || !inodes[f[9]] {
				continue
			}
			if _, port, ok := strings.Cut(f[2], ":"); ok {
				if p, err := strconv.ParseInt(port, 16, 32); err == nil && int(p) == r.dbPort {
					n++
				}
			}
		}
	}
	return n
}
