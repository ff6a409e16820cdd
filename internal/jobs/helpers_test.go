package jobs

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"worker/internal/lock"
)

// logBuf collects JSON log lines from several goroutines.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines returns the parsed log lines whose msg is msg ("" for all).
func (l *logBuf) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.b.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		dec := json.NewDecoder(strings.NewReader(line))
		dec.UseNumber() // fencing tokens do not fit a float64
		if err := dec.Decode(&m); err != nil {
			t.Fatalf("log line is not JSON: %q: %v", line, err)
		}
		if msg == "" || m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// num reads a number from a parsed log line (0 if absent).
func num(v any) int64 {
	n, _ := v.(json.Number)
	i, _ := n.Int64()
	return i
}

func newLogger(buf *logBuf) *slog.Logger {
	return slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// metric returns the value of the series name{labels} in reg, or -1 if
// the series does not exist.
func metric(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue series
				}
			}
			{
				switch {
				case m.Counter != nil:
					return m.Counter.GetValue()
				case m.Gauge != nil:
					return m.Gauge.GetValue()
				case m.Histogram != nil:
					return float64(m.Histogram.GetSampleCount())
				}
			}
		}
	}
	return -1
}

func runs(t *testing.T, reg *prometheus.Registry, job, outcome string) float64 {
	t.Helper()
	return metric(t, reg, "job_runs_total", map[string]string{"job": job, "outcome": outcome})
}

// replica is one Scheduler with its own registry and log.
type replica struct {
	s   *Scheduler
	reg *prometheus.Registry
	log *logBuf
}

func startReplica(t *testing.T, opts Options, specs ...Spec) *replica {
	t.Helper()
	r := &replica{reg: prometheus.NewRegistry(), log: &logBuf{}}
	opts.Registerer = r.reg
	opts.Logger = newLogger(r.log)
	if opts.InstanceID == "" {
		opts.InstanceID = "test"
	}
	s, err := New(opts, specs...)
	if err != nil {
		t.Fatal(err)
	}
	r.s = s
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	return r
}

func inProcess() lock.Locker { return lock.NewInProcess("test", nil) }

// state reads one job_state row.
func state(t *testing.T, pool *pgxpool.Pool, name string) Status {
	t.Helper()
	list, err := List(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range list {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("job %q not in job_state", name)
	return Status{}
}

// blocker is a job that runs until released or cancelled.
type blocker struct {
	name    string
	started chan int64 // fencing token of each run that started
	release chan struct{}
}

func newBlocker(name string) *blocker {
	return &blocker{name: name, started: make(chan int64, 16), release: make(chan struct{})}
}

func (b *blocker) Name() string { return b.name }

func (b *blocker) Run(ctx context.Context) error {
	tok, _ := FencingToken(ctx)
	b.started <- tok
	select {
	case <-b.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
