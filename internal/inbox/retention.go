package inbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
)

// reapBatch deletes at most $2 dedupe records finished before now() - $1:
// PROCESSED and RESOLVED ones. DEAD and RECOVERY_REQUIRED rows stay until
// an operator retries, resolves or purges them. SKIP LOCKED lets several
// replicas reap at once without waiting on each other.
const reapBatch = `
DELETE FROM inbox_message WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM inbox_message
     WHERE state IN ('PROCESSED', 'RESOLVED') AND finished_at < now() - $1::interval
     LIMIT $2 FOR UPDATE SKIP LOCKED))`

// attention counts the rows waiting for an operator, by source and state.
const attention = `
SELECT consumer, state, count(*) FROM inbox_message
 WHERE state IN ('DEAD', 'RECOVERY_REQUIRED') AND finished_at IS NOT NULL
 GROUP BY consumer, state`

// reap deletes expired dedupe records in batches of cfg.ReapBatch, each its
// own transaction, until none is left or ctx ends. It returns how many it
// deleted.
func reap(ctx context.Context, pool *pgxpool.Pool, cfg inboxconfig.Config) (int64, error) {
	var total int64
	for ctx.Err() == nil {
		tag, err := pool.Exec(ctx, reapBatch, cfg.Retention, cfg.ReapBatch)
		if err != nil {
			return total, err
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(cfg.ReapBatch) {
			break
		}
	}
	return total, ctx.Err()
}

// Housekeeper reaps expired records and refreshes the inbox gauges every
// cfg.ReapInterval.
type Housekeeper struct {
	pool    *pgxpool.Pool
	cfg     inboxconfig.Config
	log     *slog.Logger
	m       *Metrics
	sources []string
}

// newHousekeeper returns the housekeeper of the configured sources.
func newHousekeeper(pool *pgxpool.Pool, cfg inboxconfig.Config, log *slog.Logger, m *Metrics) *Housekeeper {
	h := &Housekeeper{pool: pool, cfg: cfg, log: log.With("job_name", "inbox-reaper"), m: m}
	for _, s := range cfg.Sources {
		h.sources = append(h.sources, s.Name)
	}
	return h
}

// Run works until ctx ends.
func (h *Housekeeper) Run(ctx context.Context) {
	t := time.NewTicker(h.cfg.ReapInterval)
	defer t.Stop()
	for {
		h.once(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (h *Housekeeper) once(ctx context.Context) {
	n, err := reap(ctx, h.pool, h.cfg)
	h.m.reaped.Add(float64(n))
	if err != nil && ctx.Err() == nil {
		h.log.Warn("inbox retention failed; it runs again next interval", "error", err, "deleted", n)
	}
	if err := h.refresh(ctx); err != nil && ctx.Err() == nil {
		h.log.Warn("inbox gauges not refreshed", "error", err)
	}
}

// refresh sets inbox_dead and inbox_recovery_required, zero for sources
// with none.
func (h *Housekeeper) refresh(ctx context.Context) error {
	rows, err := h.pool.Query(ctx, attention)
	if err != nil {
		return err
	}
	defer rows.Close()
	dead, recovery := map[string]float64{}, map[string]float64{}
	for rows.Next() {
		var source, state string
		var n float64
		if err := rows.Scan(&source, &state, &n); err != nil {
			return err
		}
		if state == "DEAD" {
			dead[source] = n
		} else {
			recovery[source] = n
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for _, s := range h.sources {
		h.m.dead.WithLabelValues(s).Set(dead[s])
		h.m.recovery.WithLabelValues(s).Set(recovery[s])
	}
	return nil
}
