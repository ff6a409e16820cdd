package tasks

import (
	"encoding/json"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// probeBackoffBase is the first wait between probes of an endpoint that
// is down, and the shortest snooze of a task waiting for it; both double
// up to tasks.probe_backoff_max.
const probeBackoffBase = 100 * time.Millisecond

// unavailableAtKey is the task metadata key that records when the task
// last waited for its endpoint (RFC 3339). It tells a task whose endpoint
// answered others since from one that only ever met the outage.
const unavailableAtKey = "endpoint_unavailable_at"

// endpointBreaker is one http kind's view of its endpoint on this replica.
// When the endpoint is unavailable (broker.Unreachable,
// broker.UnavailableStatus), the breaker opens: tasks of the kind snooze
// without calling it and without spending an attempt, except one probe at
// a time, under capped exponential backoff; the first success closes it.
// A failure is the task's own, and spends an attempt, when the endpoint
// answered other tasks since this one last waited and no other task has
// found it unavailable since (see ownFailure).
type endpointBreaker struct {
	kind   string
	log    *slog.Logger
	up     prometheus.Gauge   // task_endpoint_up{task_kind}
	opened prometheus.Counter // task_endpoint_breaker_opened_total{task_kind}
	max    time.Duration      // tasks.probe_backoff_max
	now    func() time.Time

	mu              sync.Mutex
	open            bool
	openedAt        time.Time
	probing         bool      // a probe is in flight
	probeFailures   int       // failed probes since the breaker opened
	nextProbe       time.Time // when the next probe may start
	waited          int       // tasks that snoozed while open, each once
	lastSuccess     time.Time // the endpoint's last 2xx on this replica
	lastUnavailable time.Time // the last unavailable answer, whoever got it
}

func newEndpointBreaker(kind string, m *metrics, log *slog.Logger, max time.Duration) *endpointBreaker {
	b := &endpointBreaker{
		kind: kind, log: log, max: max, now: time.Now,
		up:     m.endpointUp.WithLabelValues(kind),
		opened: m.endpointOpened.WithLabelValues(kind),
	}
	b.up.Set(1)
	return b
}

// admit says whether a task may call the endpoint now, and whether it is
// the probe of an open breaker. A task that may not snoozes.
func (b *endpointBreaker) admit() (call, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open {
		return true, false
	}
	if b.probing || b.now().Before(b.nextProbe) {
		return false, false
	}
	b.probing = true
	return true, true
}

// waiting counts a task that snoozes while the breaker is open, once per
// outage: a task whose last wait was before the breaker opened.
func (b *endpointBreaker) waiting(lastWait time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.open && lastWait.Before(b.openedAt) {
		b.waited++
	}
}

// succeeded records a 2xx: the endpoint is up, so an open breaker closes.
// It reports whether it closed the breaker.
func (b *endpointBreaker) succeeded() (closed bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	b.lastSuccess = now
	if !b.open {
		return false
	}
	b.log.Info("task endpoint available again; tasks of this kind run", "task_kind", b.kind,
		"down_for", now.Sub(b.openedAt).Round(time.Millisecond).String(), "tasks_waited", b.waited)
	b.open, b.probing, b.probeFailures, b.waited = false, false, 0, 0
	b.up.Set(1)
	return true
}

// ownFailure reports whether an unavailable answer to a task that last
// waited at lastWait is the task's own failure: the endpoint answered
// other tasks after that wait, and no task has found it unavailable since
// then. The first task to meet a new outage after an earlier one may thus
// spend an attempt; a task the endpoint refuses while it answers the
// others (a poison task) spends one on every run, and is dead-lettered
// after max_attempts. A task that never waited has no such evidence.
func (b *endpointBreaker) ownFailure(lastWait time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	own := !lastWait.IsZero() && b.lastSuccess.After(lastWait) && !b.lastUnavailable.After(b.lastSuccess)
	b.lastUnavailable = b.now()
	return own
}

// unavailable records that the endpoint was found unavailable, with cause:
// a closed breaker opens, and a failed probe pushes the next one back, to
// the endpoint's Retry-After (retryAt) if that is later.
func (b *endpointBreaker) unavailable(probe bool, cause error, retryAt time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	switch {
	case !b.open:
		b.open, b.openedAt, b.probeFailures, b.waited = true, now, 0, 0
		b.opened.Inc()
		b.up.Set(0)
		b.log.Warn("task endpoint unavailable; tasks of this kind wait for it without spending attempts, one probes it",
			"task_kind", b.kind, "error", cause)
	case probe:
		b.probing = false
		b.probeFailures++
	default:
		return // a call that started before the breaker opened
	}
	b.nextProbe = now.Add(backoff(probeBackoffBase, b.max, b.probeFailures+1))
	if retryAt.After(b.nextProbe) {
		b.nextProbe = retryAt
	}
}

// release ends a probe whose outcome says nothing about the endpoint (the
// task's own failure, a shutdown): the next task may probe at once.
func (b *endpointBreaker) release(probe bool) {
	if !probe {
		return
	}
	b.mu.Lock()
	b.probing = false
	b.mu.Unlock()
}

// backoff is exponential with equal jitter: a random duration between
// half of min(base·2^(n-1), max) and all of it, never zero, so neither
// probes nor snoozed tasks come back in step or in a busy loop.
func backoff(base, max time.Duration, n int) time.Duration {
	base = min(base, max)
	ceil := base
	for i := 1; i < n && ceil < max; i++ {
		ceil *= 2
	}
	ceil = min(ceil, max)
	half := ceil / 2
	return half + rand.N(ceil-half+1)
}

// lastWaitOf reads when a task last waited for its endpoint from its
// metadata; zero if never.
func lastWaitOf(metadata []byte) time.Time {
	var m map[string]json.RawMessage
	if json.Unmarshal(metadata, &m) != nil {
		return time.Time{}
	}
	var at time.Time
	_ = json.Unmarshal(m[unavailableAtKey], &at)
	return at
}

// snoozesOf is River's count of a task's snoozes, from its metadata.
func snoozesOf(metadata []byte) int {
	var m struct {
		Snoozes int `json:"snoozes"`
	}
	_ = json.Unmarshal(metadata, &m)
	return m.Snoozes
}
