package obs

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// RetryMetrics are job_retry_total and job_dlq_total, shared by every
// runtime that retries work and dead-letters it: the outbox relay
// (job_name="outbox-relay") and tasks (job_name=<task kind>). They are
// defined here once; each runtime asks for them on the same registry and
// gets the same collectors.
type RetryMetrics struct {
	Retry *prometheus.CounterVec // job_retry_total{job_name,outcome}
	DLQ   *prometheus.CounterVec // job_dlq_total{job_name}
}

// RetryScheduled is job_retry_total's outcome for a retry scheduled with
// backoff.
const RetryScheduled = "scheduled"

// NewRetryMetrics registers the shared retry metrics on reg, or returns the
// ones registered there before.
func NewRetryMetrics(reg prometheus.Registerer) (*RetryMetrics, error) {
	retry, err := Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "job_retry_total",
		Help: "Retries, by job (or task kind) and outcome (scheduled: a retry was scheduled with backoff).",
	}, []string{"job_name", "outcome"}))
	if err != nil {
		return nil, err
	}
	dlq, err := Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "job_dlq_total",
		Help: "Work items moved to the dead letter state (JOB_DEAD_LETTER), by job (or task kind).",
	}, []string{"job_name"}))
	if err != nil {
		return nil, err
	}
	return &RetryMetrics{Retry: retry, DLQ: dlq}, nil
}

// Start makes name's series exist at zero, so dashboards and alerts see
// them before the first retry.
func (m *RetryMetrics) Start(name string) {
	m.Retry.WithLabelValues(name, RetryScheduled)
	m.DLQ.WithLabelValues(name)
}

// Register adds c to reg, or returns the equal collector registered before.
func Register[T prometheus.Collector](reg prometheus.Registerer, c T) (T, error) {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(T); ok {
				return existing, nil
			}
		}
		return c, err
	}
	return c, nil
}
