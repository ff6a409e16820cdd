package tasks

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river/rivertype"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
	"github.com/worker-dev/worker/internal/testkit"
)

// The retry delay after the n-th error is a uniform draw from
// [0, min(max, base*2^(n-1))]: full jitter, exponential, capped.
func TestRetryPolicyIsFullJitterExponential(t *testing.T) {
	t.Parallel()
	p := retryPolicy{base: time.Second, max: 5 * time.Second}
	for errs, ceiling := range map[int]time.Duration{0: time.Second, 1: 2 * time.Second, 2: 4 * time.Second, 5: 5 * time.Second} {
		job := &rivertype.JobRow{Errors: make([]rivertype.AttemptError, errs)}
		var lowest, highest time.Duration = ceiling, 0
		for range 2000 {
			before := time.Now()
			at := p.NextRetry(job)
			after := time.Now()
			// The policy read the clock between before and after.
			if at.Before(before) || at.Sub(after) > ceiling {
				t.Fatalf("after %d errors: retry at %s, outside [now, now+%s]", errs+1, at, ceiling)
			}
			d := at.Sub(before)
			lowest, highest = min(lowest, d), max(highest, d)
		}
		// Full jitter spreads over the whole range, not around the ceiling.
		if lowest > ceiling/10 || highest < ceiling*9/10 {
			t.Errorf("after %d errors: delays span [%s, %s], want most of [0, %s]", errs+1, lowest, highest, ceiling)
		}
	}
}

// A queue without a backlog bound is allowed, with a warning at start.
func TestUnboundedQueueWarnsAtStart(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	h := start(t, db, testConfig(t, map[string]tasksconfig.Queue{"bulk": queue(1, 0)}), nil)
	lines := h.logs.Lines(t, "task queue has no backlog bound; enqueues are never refused")
	if len(lines) != 1 || lines[0]["queue"] != "bulk" || lines[0]["level"] != "WARN" {
		t.Fatalf("warning lines: %v", lines)
	}
}

// task_executor_saturation is the available backlog over max_backlog, read
// from the table with tasks{queue,state}.
func TestSaturationFollowsTheBacklog(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	cfg := testConfig(t, map[string]tasksconfig.Queue{"mail": queue(1, 4)})
	if err := publishConfig(ctx, db.Pool, &cfg); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, nil, cfg.QueueNames(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, "SELECT worker_enqueue('k', queue => 'mail') FROM generate_series(1, 3)"); err != nil {
		t.Fatal(err)
	}
	if err := m.refresh(ctx, db.Pool, &cfg); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]float64{"task_executor_saturation": 0.75, "tasks": 3} {
		labels := map[string]string{"queue": "mail"}
		if name == "tasks" {
			labels["state"] = "available"
		}
		if v, _ := testkit.Metric(t, reg, name, labels); v != want {
			t.Errorf("%s%v = %v, want %v", name, labels, v, want)
		}
	}
}

// Retry-After in seconds or as a date is honoured; a number of seconds too
// large for a time.Duration is ignored rather than wrapping around to a
// retry at once.
func TestRetryAfterParsing(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC)
	cases := []struct {
		header string
		want   time.Time
		ok     bool
	}{
		{"120", now.Add(2 * time.Minute), true},
		{"Tue, 01 Dec 2026 09:00:00 GMT", now.Add(time.Hour), true},
		{"99999999999", time.Time{}, false},
		{"-5", time.Time{}, false},
		{"soon", time.Time{}, false},
		{"", time.Time{}, false},
	}
	for _, c := range cases {
		got, ok := retryAfter(c.header, now)
		if ok != c.ok || !got.Equal(c.want) {
			t.Errorf("Retry-After %q: %v, %v; want %v, %v", c.header, got, ok, c.want, c.ok)
		}
	}
}

// A queue bounded above countCap still reaches saturation 1 when full: the
// count goes on to its max_backlog.
func TestSaturationReachesOneAboveTheCountCap(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	bound := countCap + 10
	cfg := testConfig(t, map[string]tasksconfig.Queue{"bulk": queue(1, bound)})
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg, nil, cfg.QueueNames(), nil)
	if err != nil {
		t.Fatal(err)
	}
	// River's own columns only: the admission check is not under test here.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO river_job (kind, args, queue, state, max_attempts)
		SELECT 'k', '{}', 'bulk', 'available', 3 FROM generate_series(1, $1)`, bound); err != nil {
		t.Fatal(err)
	}
	if err := m.refresh(ctx, db.Pool, &cfg); err != nil {
		t.Fatal(err)
	}
	if v, _ := testkit.Metric(t, reg, "task_executor_saturation", map[string]string{"queue": "bulk"}); v != 1 {
		t.Errorf("task_executor_saturation{queue=bulk} = %v with %d available tasks and max_backlog %d, want 1", v, bound, bound)
	}
}
