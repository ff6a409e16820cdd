package outbox

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// gauges keeps the table-derived gauges current, on a goroutine of its own.
type gauges struct {
	pool     *pgxpool.Pool
	m        *metrics
	interval time.Duration
	log      *slog.Logger
}

// run keeps the gauges current until ctx ends: one grouped query
// over the unfinished rows per metrics_interval. The query's cost grows with
// the backlog, so the pause after it is at least 50 times its duration:
// the refresher never takes more than about 2% of a core, whatever the
// backlog.
func (g *gauges) run(ctx context.Context) {
	// The first refresh comes after a random part of the interval, so
	// replicas restarted together do not all scan a large backlog at once.
	// Until then the gauges read zero.
	wait(ctx, g.interval/2+rand.N(g.interval/2+1))
	for ctx.Err() == nil {
		start := time.Now()
		if err := g.update(ctx); err != nil && ctx.Err() == nil {
			g.log.Warn("outbox metrics refresh failed", "error", err)
		}
		wait(ctx, max(g.interval, 50*time.Since(start)))
	}
}

// gaugesSQL counts rows and measures lag. The lag skips an infinite
// occurred_at (PostgreSQL cannot subtract it, and the relay dead-letters
// such rows) and reads 0 for one in the future.
const gaugesSQL = `
SELECT e.status, v.event_type, count(*),
       greatest(extract(epoch FROM now() - min(v.occurred_at) FILTER (WHERE isfinite(v.occurred_at))), 0)::float8
FROM outbox_delivery e JOIN outbox_event v ON v.id = e.id AND v.created_at = e.created_at
WHERE e.` + live + `
GROUP BY e.status, v.event_type
UNION ALL
SELECT 'DEAD', NULL, count(*), NULL FROM outbox_delivery WHERE dead_at IS NOT NULL
UNION ALL
SELECT '` + partitionsAhead + `', NULL, 0, coalesce((SELECT extract(epoch FROM max(hi) - now()) FROM outbox_partition
                                                  HAVING bool_or(lo <= now() AND hi > now())), 0)::float8`

// partitionsAhead is gaugesSQL's row for how far past now the partitions
// reach, in seconds: from now to the end of the last one, which the keeper
// creates each from the end of the one before, if one covers now at all.
const partitionsAhead = "partitions ahead"

func (g *gauges) update(ctx context.Context) error {
	counts := map[string]float64{}
	lag := map[string]float64{}
	var ahead float64
	err := pgx.BeginFunc(ctx, g.pool, func(tx pgx.Tx) error {
		// A background metric must not grab every core for a parallel
		// scan of a large backlog.
		if _, err := tx.Exec(ctx, "SET LOCAL max_parallel_workers_per_gather = 0"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, gaugesSQL)
		if err != nil {
			return err
		}
		return g.scan(rows, counts, lag, &ahead)
	})
	if err != nil {
		return err
	}
	for _, s := range []string{StatusPending, StatusInFlight, StatusFailed, StatusDead} {
		g.m.pending.WithLabelValues(s).Set(counts[s])
	}
	g.m.ahead.Set(ahead)
	// Event types seen before and now drained report 0, not their last lag.
	for _, t := range append(g.m.eventTypes.known(), otherEventType) {
		g.m.lag.WithLabelValues(t).Set(lag[t])
	}
	return nil
}

func (g *gauges) scan(rows pgx.Rows, counts, lag map[string]float64, ahead *float64) error {
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
		if status == partitionsAhead && age != nil {
			*ahead = *age
		}
		if eventType != nil && age != nil {
			t := g.m.eventType(*eventType)
			lag[t] = max(lag[t], *age)
		}
	}
	return rows.Err()
}
