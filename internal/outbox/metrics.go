package outbox

import (
	"math"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
)

// Job names under which the outbox reports in the shared job_* metrics and
// logs.
const (
	RelayJobName      = "outbox-relay"
	PartitionsJobName = "outbox-partitions"
)

// maxEventTypes bounds the event_type label: event types come from data, so
// after this many distinct values the rest are reported as "other".
const maxEventTypes = 100

// otherEventType is the label value for event types past maxEventTypes.
const otherEventType = "other"

// Failure kinds (outbox_publish_failures_total{kind}).
const (
	kindTransient   = "transient"
	kindPermanent   = "permanent"
	kindUnavailable = "unavailable" // the sink's failure, not the event's: no attempt spent
)

type metrics struct {
	pending       *prometheus.GaugeVec   // outbox_pending_size{status}
	lag           *prometheus.GaugeVec   // outbox_publisher_lag_seconds{event_type}
	published     *prometheus.CounterVec // outbox_published_total{event_type}
	failures      *prometheus.CounterVec // outbox_publish_failures_total{event_type,kind}
	latency       prometheus.Histogram   // outbox_publish_latency_seconds
	batchSize     prometheus.Histogram   // outbox_batch_size
	claimed       prometheus.Gauge       // outbox_claimed_events
	ahead         prometheus.Gauge       // outbox_partitions_ahead_seconds
	interval      prometheus.Gauge       // outbox_partition_interval_seconds
	sinkUp        prometheus.Gauge       // outbox_sink_up{sink}
	breakerOpened prometheus.Counter     // outbox_sink_breaker_opened_total{sink}
	retry         *prometheus.CounterVec // job_retry_total{job_name,outcome}
	dlq           *prometheus.CounterVec // job_dlq_total{job_name}
	eventTypes    labelCap
}

func newMetrics(reg prometheus.Registerer, sink string) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{eventTypes: labelCap{max: maxEventTypes, seen: map[string]bool{}}}
	var err error
	if m.pending, err = register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_pending_size",
		Help: "Outbox events not yet published, by status (DEAD included), refreshed every outbox.metrics_interval.",
	}, []string{"status"})); err != nil {
		return nil, err
	}
	if m.lag, err = register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_publisher_lag_seconds",
		Help: "Age (now - occurred_at) of the oldest unfinished event, by event type; 0 when none. At most 100 event types, then \"other\".",
	}, []string{"event_type"})); err != nil {
		return nil, err
	}
	if m.ahead, err = register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_partitions_ahead_seconds",
		Help: "How far past now the outbox_event partitions reach, in seconds (0 when no partition covers now), refreshed every outbox.metrics_interval. At 0 every insert fails.",
	})); err != nil {
		return nil, err
	}
	if m.interval, err = register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_partition_interval_seconds",
		Help: "The configured outbox.partition_interval, in seconds: the length of a new outbox_event partition. Alerts compare outbox_partitions_ahead_seconds with it.",
	})); err != nil {
		return nil, err
	}
	if m.published, err = register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_published_total",
		Help: "Events handed to the sink and marked PUBLISHED.",
	}, []string{"event_type"})); err != nil {
		return nil, err
	}
	if m.failures, err = register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_publish_failures_total",
		Help: "Failed publish attempts, by event type and kind (transient: retried or DEAD after max_attempts; permanent: DEAD at once; unavailable: the sink was down, the event waits without spending an attempt).",
	}, []string{"event_type", "kind"})); err != nil {
		return nil, err
	}
	if m.latency, err = register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "outbox_publish_latency_seconds",
		Help:    "Time from an event's occurred_at to its successful publish.",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 1800},
	})); err != nil {
		return nil, err
	}
	if m.batchSize, err = register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "outbox_batch_size",
		Help:    "Events claimed per relay batch.",
		Buckets: []float64{1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000},
	})); err != nil {
		return nil, err
	}
	if m.claimed, err = register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_claimed_events",
		Help: "Events this process holds claimed (locked in a batch transaction) right now. The table shows them as PENDING or FAILED; this is their IN_FLIGHT count.",
	})); err != nil {
		return nil, err
	}
	sinkUpVec, err := register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_sink_up",
		Help: "1 while the relay's sink takes publishes, 0 while its breaker is open: the sink is unavailable, claiming has stopped and events wait with their attempts untouched.",
	}, []string{"sink"}))
	if err != nil {
		return nil, err
	}
	m.sinkUp = sinkUpVec.WithLabelValues(sink)
	m.sinkUp.Set(1)
	openedVec, err := register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_sink_breaker_opened_total",
		Help: "Times the relay found its sink unavailable and stopped claiming until a probe got through.",
	}, []string{"sink"}))
	if err != nil {
		return nil, err
	}
	m.breakerOpened = openedVec.WithLabelValues(sink)
	// job_retry_total and job_dlq_total are defined once, in obs, and
	// shared with tasks.
	shared, err := obs.NewRetryMetrics(reg)
	if err != nil {
		return nil, err
	}
	m.retry, m.dlq = shared.Retry, shared.DLQ

	// Known label values start at zero so dashboards and alerts see every
	// series before the first event.
	for _, s := range []string{StatusPending, StatusInFlight, StatusFailed, StatusDead} {
		m.pending.WithLabelValues(s)
	}
	shared.Start(RelayJobName)
	// Event types come from data, so their series cannot all exist from
	// the start. The "other" series (the overflow label value) do, so that
	// outbox_publish_failures_total has both kinds before the first
	// failure; and an event type's series start at zero when the type is
	// first seen (eventType), so rate() sees its first failure too.
	m.initEventType(otherEventType)
	return m, nil
}

// eventType returns the label value for an event type: control characters
// replaced (rows from before the producer rules may have them), bounded by
// the cap. A value seen for the first time gets its counters at zero.
func (m *metrics) eventType(t string) string {
	v, first := m.eventTypes.value(labelSafe(t))
	if first {
		m.initEventType(v)
	}
	return v
}

func (m *metrics) initEventType(v string) {
	m.published.WithLabelValues(v)
	m.failures.WithLabelValues(v, kindTransient)
	m.failures.WithLabelValues(v, kindPermanent)
	m.failures.WithLabelValues(v, kindUnavailable)
}

// observeLatency records one publish latency. A negative one (an
// occurred_at in the future) or one too large for a time.Duration (which
// time.Time.Sub saturates, some 292 years) says nothing about the relay
// and would distort the histogram's sum, so it is left out.
func (m *metrics) observeLatency(d time.Duration) {
	if d < 0 || d == math.MaxInt64 {
		return
	}
	m.latency.Observe(d.Seconds())
}

// labelSafe replaces control characters with '_', so a label value stays
// one readable line in the exposition, dashboards and alerts.
func labelSafe(s string) string {
	if !hasControl(s) {
		return s
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return '_'
		}
		return r
	}, s)
}

// register adds c to reg, or returns the equal collector registered before.
func register[T prometheus.Collector](reg prometheus.Registerer, c T) (T, error) {
	return obs.Register(reg, c)
}

// labelCap admits the first max distinct values of a label and maps the
// rest to otherEventType.
type labelCap struct {
	mu   sync.Mutex
	max  int
	seen map[string]bool
}

// value returns the label value for v, and whether v was admitted just
// now.
func (l *labelCap) value(v string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen[v] {
		return v, false
	}
	if len(l.seen) >= l.max {
		return otherEventType, false
	}
	l.seen[v] = true
	return v, true
}

// known returns the admitted values.
func (l *labelCap) known() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, 0, len(l.seen))
	for v := range l.seen {
		out = append(out, v)
	}
	return out
}
