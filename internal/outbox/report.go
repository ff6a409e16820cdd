package outbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/obs"
)

// reporter turns outcomes into metrics and log lines: a batch's once the
// claimer committed them, a detached publish's once the completer wrote
// it, and the sink's outages as the breaker sees them. It holds no state
// of its own; the collectors and the logger are safe for concurrent use.
type reporter struct {
	m               *metrics
	log             *slog.Logger
	pool            *pgxpool.Pool // counts the events an outage kept waiting
	probeBackoffMax time.Duration
}

// record updates metrics and logs once the outcomes are committed.
func (r *reporter) record(out *outcomes) {
	counts := map[string]int{}
	for i, ev := range out.published {
		counts[ev.EventType]++
		r.m.observeLatency(out.at[i].Sub(ev.OccurredAt))
	}
	for t, n := range counts {
		r.m.published.WithLabelValues(r.m.eventType(t)).Add(float64(n))
	}
	for _, f := range out.failed {
		kind := kindTransient
		if IsPermanent(f.err) {
			kind = kindPermanent
		}
		r.m.failures.WithLabelValues(r.m.eventType(f.ev.EventType), kind).Inc()
		attrs := []any{
			"event_id", f.ev.EventID, "aggregate_type", f.ev.AggregateType, "aggregate_id", f.ev.AggregateID,
			"event_type", f.ev.EventType, "attempts", f.ev.Attempts + 1, "error", f.err,
		}
		if f.status == StatusDead {
			r.m.dlq.WithLabelValues(RelayJobName).Inc()
			r.log.Error("outbox event dead-lettered", append(attrs, "error.code", obs.CodeJobDeadLetter, "permanent", kind == kindPermanent)...)
			continue
		}
		r.m.retry.WithLabelValues(RelayJobName, "scheduled").Inc()
		r.log.Warn("outbox publish failed; retry scheduled", append(attrs, "retry_in", f.delay)...)
	}
}

// unavailable counts a publish of ev that failed because the sink is
// unavailable; such failures are never logged per event.
func (r *reporter) unavailable(ev Event) {
	r.m.failures.WithLabelValues(r.m.eventType(ev.EventType), kindUnavailable).Inc()
}

// sinkDown logs the outage once, with its cause: the breaker opened.
func (r *reporter) sinkDown(cause error) {
	r.m.sinkUp.Set(0)
	r.m.breakerOpened.Inc()
	r.log.Warn("outbox sink unavailable; claiming stops, events wait with their attempts untouched, one event probes the sink until it answers",
		"error", cause, "probe_backoff_max", r.probeBackoffMax)
}

// sinkBack logs the end of the outage once: how long it lasted and how
// many events waited for it.
func (r *reporter) sinkBack(openFor time.Duration) {
	r.m.sinkUp.Set(1)
	attrs := []any{"open_for", openFor.Round(time.Millisecond).String()}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var waiting int64
	if err := r.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_delivery WHERE `+live).Scan(&waiting); err == nil {
		attrs = append(attrs, "events_waiting", waiting)
	}
	r.log.Info("outbox sink available again; claiming resumes", attrs...)
}

// retryPolicy decides what a failed publish makes of its event.
type retryPolicy struct {
	maxAttempts int
	base, max   time.Duration
}

// classify turns a publish error into the event's next state.
func (p retryPolicy) classify(ev claimedRow, err error) failure {
	f := failure{ev: ev, err: err, status: StatusFailed}
	attempts := ev.Attempts + 1
	if IsPermanent(err) || attempts >= p.maxAttempts {
		f.status = StatusDead
		return f
	}
	f.delay = retryDelay(p.base, p.max, attempts, err)
	return f
}
