package outbox

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/pglisten"
)

// listen keeps a dedicated connection LISTENing on NotifyChannel and wakes
// the loops on every notification. It is only an accelerator: the loops poll
// anyway, so while it reconnects events are late by at most poll_interval.
// LISTEN needs a session, so behind a transaction-mode pooler point the
// worker at PostgreSQL directly or accept polling latency.
//
// The same session holds the relay's marker and watches the other relays'
// (marker.go), so it lasts until the relay has stopped: while detached
// publishes finish after claiming stopped, the marker must stay.
func (r *Relay) listen() {
	defer r.background.Done()
	cfg := r.pool.Config().ConnConfig
	cfg.RuntimeParams["application_name"] = "outbox-listener"
	l := pglisten.Listener{Name: "outbox listener", Config: cfg, Channel: NotifyChannel, Log: r.log,
		Fallback: "relays poll every outbox.poll_interval", Hooks: r.markerHooks()}
	ctx, cancel := context.WithCancel(context.WithoutCancel(r.hardCtx))
	go func() {
		<-r.stopped
		cancel()
	}()
	// Rows inserted while nobody listened woke nobody: wake on connect.
	l.Run(ctx, r.wakeAll, func(string) { r.wakeAll() })
}

// refreshMetrics keeps the table-derived gauges current: one grouped query
// over the unfinished rows per metrics_interval. The query's cost grows with
// the backlog, so the pause after it is at least 50 times its duration:
// the refresher never takes more than about 2% of a core, whatever the
// backlog.
func (r *Relay) refreshMetrics() {
	defer r.background.Done()
	// The first refresh comes after a random part of the interval, so
	// replicas restarted together do not all scan a large backlog at once.
	// Until then the gauges read zero.
	wait(r.claimCtx, r.cfg.MetricsInterval/2+rand.N(r.cfg.MetricsInterval/2+1))
	for r.claimCtx.Err() == nil {
		start := time.Now()
		if err := r.updateGauges(r.claimCtx); err != nil && r.claimCtx.Err() == nil {
			r.log.Warn("outbox metrics refresh failed", "error", err)
		}
		wait(r.claimCtx, max(r.cfg.MetricsInterval, 50*time.Since(start)))
	}
}

// gaugesSQL counts rows and measures lag. The lag skips an infinite
// occurred_at (PostgreSQL cannot subtract it, and the relay dead-letters
// such rows) and reads 0 for one in the future.
const gaugesSQL = `
SELECT status, event_type, count(*),
       greatest(extract(epoch FROM now() - min(occurred_at) FILTER (WHERE isfinite(occurred_at))), 0)::float8
FROM outbox_event WHERE ` + unfinished + `
GROUP BY status, event_type
UNION ALL
SELECT 'DEAD', NULL, count(*), NULL FROM outbox_event WHERE status = 'DEAD'`

func (r *Relay) updateGauges(ctx context.Context) error {
	counts := map[string]float64{}
	lag := map[string]float64{}
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		// A background metric must not grab every core for a parallel
		// scan of a large backlog.
		if _, err := tx.Exec(ctx, "SET LOCAL max_parallel_workers_per_gather = 0"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, gaugesSQL)
		if err != nil {
			return err
		}
		return r.scanGauges(rows, counts, lag)
	})
	if err != nil {
		return err
	}
	for _, s := range []string{StatusPending, StatusInFlight, StatusFailed, StatusDead} {
		r.m.pending.WithLabelValues(s).Set(counts[s])
	}
	// Event types seen before and now drained report 0, not their last lag.
	for _, t := range append(r.m.eventTypes.known(), otherEventType) {
		r.m.lag.WithLabelValues(t).Set(lag[t])
	}
	return nil
}

func (r *Relay) scanGauges(rows pgx.Rows, counts, lag map[string]float64) error {
	defer rows.Close()
	for rows.Next() {
		var status string
		var eventType *string
		var n int64
		var age *float64
		if err := rows.Scan(&status, &eventType, &n, &age); err != nil {
			return err
		}
		counts[status] += float64(n)
		if eventType != nil && age != nil {
			t := r.m.eventType(*eventType)
			lag[t] = max(lag[t], *age)
		}
	}
	return rows.Err()
}
