// Package testkit holds helpers shared by the tests of several packages.
// Only _test.go files import it.
package testkit

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
)

// LogBuffer collects log output from several goroutines: slog handlers and
// child processes write concurrently with the test reading it.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Logger returns a debug-level JSON slog.Logger writing into b. Tests log
// into a buffer rather than t.Log because background goroutines may still
// log for a moment after a test returns. Durations are written as the
// process logger writes them (obs.DurationText), so tests read what
// operators read.
func (b *LogBuffer) Logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug, ReplaceAttr: obs.DurationText}))
}

// Lines returns the JSON log lines whose msg is msg ("" for all). Numbers
// decode as json.Number: fencing tokens do not fit a float64.
func (b *LogBuffer) Lines(t testing.TB, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.SplitSeq(b.String(), "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		var m map[string]any
		dec := json.NewDecoder(strings.NewReader(line))
		dec.UseNumber()
		err := dec.Decode(&m)
		if err == nil {
			// As strict as json.Unmarshal: one value per line.
			if _, tail := dec.Token(); tail != io.EOF {
				err = errors.New("trailing data after the JSON value")
			}
		}
		if err != nil {
			t.Fatalf("log line is not JSON: %q: %v", line, err)
		}
		if msg == "" || m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// Eventually polls cond every few milliseconds until it holds, failing t
// with what after within. Polling, not sleeping, is how tests synchronize
// with background work.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// HistogramSum reads the sum of the unlabelled histogram name from g.
func HistogramSum(t testing.TB, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetHistogram().GetSampleSum()
		}
	}
	t.Fatalf("no histogram %s", name)
	return 0
}

// Metric reads the series name{labels} from g, labels being exactly the
// series' labels: a counter's or gauge's value, or a histogram's sample
// count. found is false when there is no such series.
func Metric(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) (value float64, found bool) {
	t.Helper()
	mfs, err := g.Gather()
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
				if v, ok := labels[lp.GetName()]; !ok || v != lp.GetValue() {
					continue series
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue(), true
			case m.Gauge != nil:
				return m.GetGauge().GetValue(), true
			case m.Histogram != nil:
				return float64(m.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}
