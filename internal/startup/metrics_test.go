package startup

import (
	"context"
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/opsserver"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Prometheus sets job and instance on every series it scrapes and renames
// a target's own job label to exported_job, so a query on job="x" finds
// nothing. No metric of the wired worker may carry either.
func TestNoMetricUsesAReservedLabel(t *testing.T) {
	t.Parallel()
	parts, cleanup, reg := startWired(t, pgtest.New(t), `
jobs:
  - {name: tick, kind: sql, sql: "SELECT 1", delay: 1h}
`, "APP_OUTBOX_ENABLED=true")
	defer cleanup()
	for _, p := range parts {
		defer p.Shutdown(context.Background())
	}
	registerOpsMetrics(reg, &opsserver.Readiness{})

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) < 20 {
		t.Fatalf("gathered %d metric families; the wired worker registers more", len(mfs))
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "job" || lp.GetName() == "instance" {
					t.Errorf("%s has a label %q; Prometheus owns it (use job_name for a job)", mf.GetName(), lp.GetName())
				}
			}
		}
	}
	// The job label is job_name, on every job metric, from the start.
	if _, ok := testkit.Metric(t, reg, "job_runs_total", map[string]string{"job_name": "tick", "outcome": "success"}); !ok {
		t.Error(`job_runs_total{job_name="tick",outcome="success"} is missing before the first run`)
	}
	for _, name := range []string{"job_duration_seconds", "job_last_success_timestamp_seconds", "job_running", "job_delay_seconds"} {
		if _, ok := testkit.Metric(t, reg, name, map[string]string{"job_name": "tick"}); !ok {
			t.Errorf(`%s{job_name="tick"} is missing before the first run`, name)
		}
	}
}

func TestBuildInfoNamesTheBuild(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	registerOpsMetrics(reg, &opsserver.Readiness{})
	b := CurrentBuild()
	v, ok := testkit.Metric(t, reg, "worker_build_info", map[string]string{"version": Version, "revision": b.Revision, "build_date": "unknown", "goversion": runtime.Version()})
	if !ok || v != 1 {
		t.Fatalf("worker_build_info{version=%q,revision=%q,build_date=\"unknown\",goversion=%q} = %v (found %v), want 1", Version, b.Revision, runtime.Version(), v, ok)
	}
	if b.Revision == "" {
		t.Error("revision is empty; want the ldflags value, vcs.revision or \"unknown\"")
	}
	// Not started yet: /readyz would answer 503, and so does the metric.
	if v, ok := testkit.Metric(t, reg, "worker_ready", nil); !ok || v != 0 {
		t.Errorf("worker_ready = %v (found %v) before start, want 0", v, ok)
	}
}
