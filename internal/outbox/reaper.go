package outbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultReaperChunk is how many rows one reaper statement deletes.
const DefaultReaperChunk = 1000

// Reaper deletes PUBLISHED events older than Retention. DEAD events are
// never touched: they wait for an operator. It has the shape of a scheduled
// job (Name, Run); register it under the name "outbox-reaper".
type Reaper struct {
	Pool      *pgxpool.Pool
	Retention time.Duration
	// Chunk bounds each DELETE (default DefaultReaperChunk), so no
	// statement holds many row locks or writes a burst of WAL, and
	// autovacuum keeps up between chunks.
	Chunk int
	Log   *slog.Logger // nil: no logging
}

// NewReaper returns a reaper with the default chunk size.
func NewReaper(pool *pgxpool.Pool, retention time.Duration, log *slog.Logger) *Reaper {
	return &Reaper{Pool: pool, Retention: retention, Chunk: DefaultReaperChunk, Log: log}
}

// Name is the job name, also its lease key.
func (r *Reaper) Name() string { return ReaperJobName }

// Run deletes old PUBLISHED events chunk by chunk until none is left or
// ctx ends.
func (r *Reaper) Run(ctx context.Context) error {
	log := r.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("job", ReaperJobName)
	deleted, chunks, err := r.Reap(ctx)
	if err != nil {
		log.Warn("outbox reaper stopped", "deleted", deleted, "chunks", chunks, "error", err)
		return err
	}
	log.Info("outbox reaper done", "deleted", deleted, "chunks", chunks, "retention", r.Retention.String())
	return nil
}

// reapSQL deletes one chunk, oldest first, through the partial index on
// PUBLISHED rows. Each chunk is its own short transaction.
const reapSQL = `
DELETE FROM outbox_event
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM outbox_event
    WHERE status = 'PUBLISHED' AND published_at < $1
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`

// Reap is Run's work. It returns how many rows it deleted, in how many
// statements.
func (r *Reaper) Reap(ctx context.Context) (deleted int64, chunks int, err error) {
	chunk := r.Chunk
	if chunk <= 0 {
		chunk = DefaultReaperChunk
	}
	// One cutoff for the whole run, on the database clock.
	var cutoff time.Time
	if err := r.Pool.QueryRow(ctx, "SELECT now() - make_interval(secs => $1)", r.Retention.Seconds()).Scan(&cutoff); err != nil {
		return 0, 0, err
	}
	for {
		tag, err := r.Pool.Exec(ctx, reapSQL, cutoff, chunk)
		if err != nil {
			return deleted, chunks, err
		}
		chunks++
		deleted += tag.RowsAffected()
		if tag.RowsAffected() < int64(chunk) {
			return deleted, chunks, nil
		}
		if err := ctx.Err(); err != nil {
			return deleted, chunks, err
		}
	}
}
