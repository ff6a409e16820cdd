package tasks

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river/rivertype"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// Outcomes of task_runs_total{outcome}: how one run of a task ended.
const (
	OutcomeSuccess     = "success"
	OutcomeFailure     = "failure"     // error or panic; retried, or dead-lettered after the last attempt
	OutcomeTimeout     = "timeout"     // ran past its kind's timeout (JOB_TIMEOUT); retried like a failure
	OutcomePermanent   = "permanent"   // permanent error: dead-lettered at once, as cancelled
	OutcomeInterrupted = "interrupted" // cancelled at the end of the shutdown budget; runs again, no attempt used
	OutcomeCancelled   = "cancelled"   // cancelled by an operator while it ran
	OutcomeSnoozed     = "snoozed"     // asked to run again later (river.JobSnooze)
)

var outcomes = []string{OutcomeSuccess, OutcomeFailure, OutcomeTimeout, OutcomePermanent,
	OutcomeInterrupted, OutcomeCancelled, OutcomeSnoozed}

// states are River's job states, the values of tasks{state}.
var states = []rivertype.JobState{
	rivertype.JobStateAvailable, rivertype.JobStateCancelled, rivertype.JobStateCompleted,
	rivertype.JobStateDiscarded, rivertype.JobStatePending, rivertype.JobStateRetryable,
	rivertype.JobStateRunning, rivertype.JobStateScheduled,
}

// countCap bounds each tasks{queue,state} count, so the refresh costs at most
// this many index entries per series however large river_job grows. The
// gauge reads countCap when there are more. A larger max_backlog raises it
// (countLimit): a saturation computed from a count that stops short of the
// bound would never reach 1, and the full-queue alert would never fire.
const countCap = 100000

// countLimit is where the refresh stops counting: countCap, or the largest
// max_backlog if that is larger.
func countLimit(cfg *tasksconfig.Config) int {
	limit := countCap
	for _, q := range cfg.Queues {
		limit = max(limit, q.Backlog())
	}
	return limit
}

type metrics struct {
	runs       *prometheus.CounterVec   // task_runs_total{task_kind,outcome}
	duration   *prometheus.HistogramVec // task_duration_seconds{task_kind}
	wait       *prometheus.HistogramVec // task_queue_wait_seconds{queue}
	tasks      *prometheus.GaugeVec     // tasks{queue,state}
	saturation *prometheus.GaugeVec     // task_executor_saturation{queue}
	shared     *obs.RetryMetrics        // job_retry_total, job_dlq_total

	endpointUp     *prometheus.GaugeVec   // task_endpoint_up{task_kind}
	endpointOpened *prometheus.CounterVec // task_endpoint_breaker_opened_total{task_kind}
}

// newMetrics registers the task metrics, with a series at zero for every
// kind and queue, and for every http kind in httpKinds its endpoint's.
func newMetrics(reg prometheus.Registerer, kinds, queues, httpKinds []string) (*metrics, error) {
	shared, err := obs.NewRetryMetrics(reg)
	if err != nil {
		return nil, err
	}
	m := &metrics{
		shared: shared,
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "task_runs_total", Help: "Task runs on this replica, by kind and outcome.",
		}, []string{"task_kind", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "task_duration_seconds", Help: "Duration of task runs, whatever their outcome.",
			Buckets: []float64{.005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900},
		}, []string{"task_kind"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "task_queue_wait_seconds", Help: "Time from a task being due (scheduled_at) to its run starting on this replica.",
			Buckets: []float64{.005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900},
		}, []string{"queue"}),
		tasks: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tasks", Help: "Tasks by queue and River state, cluster-wide, refreshed every tasks.metrics_interval; each count stops at 100000, or at the largest max_backlog if larger.",
		}, []string{"queue", "state"}),
		saturation: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "task_executor_saturation", Help: "Available (waiting) tasks of a queue divided by its max_backlog; at 1 enqueues are refused (JOB_EXECUTOR_REJECTED). 0 for an unbounded queue.",
		}, []string{"queue"}),
		endpointUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "task_endpoint_up", Help: "1 while an http task kind's endpoint answers, 0 while its breaker is open (the endpoint is unavailable; tasks wait without spending attempts), as this replica sees it.",
		}, []string{"task_kind"}),
		endpointOpened: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "task_endpoint_breaker_opened_total", Help: "Times an http task kind's endpoint was found unavailable and its breaker opened on this replica.",
		}, []string{"task_kind"}),
	}
	for _, c := range []prometheus.Collector{m.runs, m.duration, m.wait, m.tasks, m.saturation, m.endpointUp, m.endpointOpened} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Every known series exists from the start, at zero.
	for _, k := range kinds {
		for _, o := range outcomes {
			m.runs.WithLabelValues(k, o)
		}
		m.duration.WithLabelValues(k)
		shared.Start(k)
	}
	for _, k := range httpKinds {
		m.endpointUp.WithLabelValues(k).Set(1)
		m.endpointOpened.WithLabelValues(k)
	}
	for _, q := range queues {
		m.wait.WithLabelValues(q)
		m.saturation.WithLabelValues(q)
		for _, s := range states {
			m.tasks.WithLabelValues(q, string(s))
		}
	}
	return m, nil
}

// refresh reads tasks{queue,state} and task_executor_saturation from the
// table: one statement, each count bounded by countCap through the index
// River fetches with (state, queue, ...).
func (m *metrics) refresh(ctx context.Context, pool *pgxpool.Pool, cfg *tasksconfig.Config) error {
	queues := cfg.QueueNames()
	stateNames := make([]string, len(states))
	for i, s := range states {
		stateNames[i] = string(s)
	}
	rows, err := pool.Query(ctx, `
		SELECT q, s, (SELECT count(*) FROM (
		        SELECT 1 FROM river_job j WHERE j.state = s::river_job_state AND j.queue = q LIMIT $3) c)
		  FROM unnest($1::text[]) q CROSS JOIN unnest($2::text[]) s`, queues, stateNames, countLimit(cfg))
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			q, s string
			n    int64
		)
		if err := rows.Scan(&q, &s, &n); err != nil {
			return err
		}
		m.tasks.WithLabelValues(q, s).Set(float64(n))
		if s == string(rivertype.JobStateAvailable) {
			if limit := cfg.Queues[q].Backlog(); limit > 0 {
				m.saturation.WithLabelValues(q).Set(float64(n) / float64(limit))
			}
		}
	}
	return rows.Err()
}

// refreshLoop runs refresh every interval until ctx ends.
func (m *metrics) refreshLoop(ctx context.Context, pool *pgxpool.Pool, cfg *tasksconfig.Config, log *slog.Logger) {
	t := time.NewTicker(cfg.MetricsInterval)
	defer t.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, cfg.MetricsInterval)
		if err := m.refresh(qctx, pool, cfg); err != nil && ctx.Err() == nil {
			log.Warn("task metrics refresh failed", "error", err)
		}
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
