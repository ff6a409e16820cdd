package inbox

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
)

// JobName is the job_name under which a source's consumer reports in the
// shared job_retry_total and job_dlq_total, and in logs.
func JobName(source string) string { return "inbox:" + source }

// Metrics are the inbox's series. The source label takes the configured
// source names only, so its cardinality is the configuration's.
type Metrics struct {
	received      *prometheus.CounterVec   // inbox_received_total{source,outcome}
	latency       *prometheus.HistogramVec // inbox_processing_seconds{source}
	recovery      *prometheus.GaugeVec     // inbox_recovery_required{source}
	dead          *prometheus.GaugeVec     // inbox_dead{source}
	recoveryFound *prometheus.CounterVec   // inbox_recovery_required_total{source}
	sourceUp      *prometheus.GaugeVec     // inbox_source_up{source}
	dbErrors      *prometheus.CounterVec   // inbox_transaction_errors_total{source}
	unstorable    *prometheus.CounterVec   // inbox_unstorable_total{source}
	reaped        prometheus.Counter       // inbox_reaped_total
	shared        *obs.RetryMetrics        // job_retry_total, job_dlq_total
}

// NewMetrics registers the inbox's metrics on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{}
	var err error
	reg1 := func(c prometheus.Collector) {
		if err == nil {
			_, err = obs.Register(reg, c)
		}
	}
	m.received = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "inbox_received_total",
		Help: "Deliveries the inbox settled, by source and outcome (processed, duplicate, failed: a retry follows, dead).",
	}, []string{"source", "outcome"})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "inbox_processing_seconds",
		Help:    "From a batch's hand-over by its source to the commit of a message's work.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
	}, []string{"source"})
	m.recovery = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "inbox_recovery_required",
		Help: "Messages whose processing lease expired before their work committed, waiting for an operator (worker inbox recovery), by source; refreshed every inbox.reap_interval.",
	}, []string{"source"})
	m.dead = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "inbox_dead",
		Help: "Dead-lettered messages (worker inbox dead), by source; refreshed every inbox.reap_interval.",
	}, []string{"source"})
	m.recoveryFound = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "inbox_recovery_required_total",
		Help: "Messages this replica found with an expired processing lease and handed to an operator, by source.",
	}, []string{"source"})
	m.sourceUp = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "inbox_source_up",
		Help: "1 while the source is connected, 0 during an outage (no message's attempt is spent), by source.",
	}, []string{"source"})
	m.dbErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "inbox_transaction_errors_total",
		Help: "Inbox transactions that failed for the database's sake (no attempt spent), by source.",
	}, []string{"source"})
	m.unstorable = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "inbox_unstorable_total",
		Help: "Deliveries whose text the database cannot store (a NUL byte, or not UTF-8, in a key, subject, source, type or header), dead-lettered at once, by source.",
	}, []string{"source"})
	m.reaped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "inbox_reaped_total",
		Help: "Dedupe records removed by retention (inbox.retention).",
	})
	for _, c := range []prometheus.Collector{m.received, m.latency, m.recovery, m.dead, m.recoveryFound, m.sourceUp, m.dbErrors, m.unstorable, m.reaped} {
		reg1(c)
	}
	if err != nil {
		return nil, err
	}
	if m.shared, err = obs.NewRetryMetrics(reg); err != nil {
		return nil, err
	}
	return m, nil
}

// initSource makes the source's series exist at zero.
func (m *Metrics) initSource(name string) {
	for _, o := range []Outcome{Processed, Duplicate, Failed, Dead} {
		m.received.WithLabelValues(name, string(o))
	}
	m.latency.WithLabelValues(name)
	m.recovery.WithLabelValues(name)
	m.dead.WithLabelValues(name)
	m.recoveryFound.WithLabelValues(name)
	m.sourceUp.WithLabelValues(name)
	m.dbErrors.WithLabelValues(name)
	m.unstorable.WithLabelValues(name)
	m.shared.Start(JobName(name))
}
