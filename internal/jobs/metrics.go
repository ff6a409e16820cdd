package jobs

import (
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of job_runs_total{outcome}. The first five end a run that
// started; the others are attempts that did not start a run.
const (
	OutcomeSuccess   = "success"
	OutcomeFailure   = "failure"    // error or panic
	OutcomeTimeout   = "timeout"    // JOB_TIMEOUT
	OutcomeLeaseLost = "lease_lost" // renewal failed; the run was cancelled
	OutcomeCancelled = "cancelled"  // cancelled at the end of the shutdown budget

	OutcomeSkippedLocked  = "skipped_locked"  // another replica holds the lease
	OutcomeSkippedNotDue  = "skipped_not_due" // the lease was free but the cluster-wide delay has not passed
	OutcomeSkippedOverlap = "skipped_overlap" // the previous run on this replica was still running
	OutcomeRejected       = "rejected"        // no free slot: JOB_EXECUTOR_REJECTED
)

var outcomes = []string{
	OutcomeSuccess, OutcomeFailure, OutcomeTimeout, OutcomeLeaseLost, OutcomeCancelled,
	OutcomeSkippedLocked, OutcomeSkippedNotDue, OutcomeSkippedOverlap, OutcomeRejected,
}

type metrics struct {
	runs        *prometheus.CounterVec
	duration    *prometheus.HistogramVec
	lastSuccess *prometheus.GaugeVec
	running     *prometheus.GaugeVec
	delay       *prometheus.GaugeVec
	rejected    prometheus.Counter
	saturation  prometheus.Gauge
}

// jobLabel names the job on every job metric. Not "job": Prometheus owns
// that label (the scrape job) and renames ours to exported_job.
const jobLabel = "job_name"

func newMetrics(reg prometheus.Registerer, entries []*entry) (*metrics, error) {
	m := &metrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "job_runs_total", Help: "Scheduled job attempts by outcome.",
		}, []string{jobLabel, "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "job_duration_seconds", Help: "Duration of job runs that started, whatever their outcome.",
			// Jobs run from milliseconds (a small UPDATE) to many minutes.
			Buckets: []float64{.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 1800},
		}, []string{jobLabel}),
		lastSuccess: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "job_last_success_timestamp_seconds", Help: "Unix time of the last successful run on this replica (0: none yet).",
		}, []string{jobLabel}),
		running: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "job_running", Help: "1 while the job runs on this replica.",
		}, []string{jobLabel}),
		delay: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "job_delay_seconds", Help: "The job's configured delay between runs, so alerts can compare the time since its last success with it.",
		}, []string{jobLabel}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "executor_rejected_total", Help: "Job runs refused because APP_ASYNC_EXECUTOR_MAX_SIZE jobs were already running.",
		}),
		saturation: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "executor_saturation", Help: "Running jobs divided by APP_ASYNC_EXECUTOR_MAX_SIZE.",
		}),
	}
	for _, c := range []prometheus.Collector{m.runs, m.duration, m.lastSuccess, m.running, m.delay, m.rejected, m.saturation} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Every series exists from the start, so dashboards and alerts see
	// zeros rather than gaps before the first event.
	for _, e := range entries {
		for _, o := range outcomes {
			m.runs.WithLabelValues(e.name, o)
		}
		m.duration.WithLabelValues(e.name)
		m.lastSuccess.WithLabelValues(e.name)
		m.running.WithLabelValues(e.name)
		m.delay.WithLabelValues(e.name).Set(e.spec.Delay.Seconds())
	}
	return m, nil
}

func (m *metrics) count(job, outcome string) { m.runs.WithLabelValues(job, outcome).Inc() }

// overlapMonitor is gocron's hook for singleton reschedules: gocron calls it
// when a job's timer fires while the previous run on this replica still
// runs, and skips that firing.
type overlapMonitor struct{ m *metrics }

func (o overlapMonitor) IncrementJob(_ uuid.UUID, name string, _ []string, status gocron.JobStatus) {
	if status == gocron.SingletonRescheduled {
		o.m.count(name, OutcomeSkippedOverlap)
	}
}

func (overlapMonitor) RecordJobTiming(time.Time, time.Time, uuid.UUID, string, []string) {}
