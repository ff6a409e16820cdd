package startup

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/obs"
)

// dbHealthEvery is how often dbHealth pings the database, and
// dbPingTimeout bounds each ping, as a readiness check is bounded.
const (
	dbHealthEvery = 500 * time.Millisecond
	dbPingTimeout = time.Second
)

// dbHealth tells an operator, once, that the database went away. Without
// it an outage is a WARN from every relay loop, listener and job attempt,
// each naming its own failed statement, and no line that says the cause.
// It logs one ERROR when the database stops answering and one INFO when it
// answers again, with how long it was away. A ping that fails on a
// connection the server ended (a restart, pg_terminate_backend) is tried
// again at once on a new one: only a database that refuses a fresh
// connection is down. /readyz judges the database on its own check.
type dbHealth struct {
	pool *pgxpool.Pool // the readiness probe's pool
	log  *slog.Logger

	stop context.CancelFunc
	done chan struct{}
	once sync.Once
}

func (h *dbHealth) Start(context.Context) error {
	ctx, stop := context.WithCancel(context.Background())
	h.stop, h.done = stop, make(chan struct{})
	go h.run(ctx)
	return nil
}

// Shutdown stops the pings; it may be called without Start, and twice.
func (h *dbHealth) Shutdown(ctx context.Context) error {
	h.once.Do(func() {
		if h.stop == nil {
			return
		}
		h.stop()
		select {
		case <-h.done:
		case <-ctx.Done():
		}
	})
	return nil
}

func (h *dbHealth) run(ctx context.Context) {
	defer close(h.done)
	t := time.NewTicker(dbHealthEvery)
	defer t.Stop()
	var downSince time.Time // zero while the database answers
	for {
		err := h.ping(ctx)
		if err != nil {
			err = h.ping(ctx) // the first may have met a connection the server ended
		}
		switch {
		case ctx.Err() != nil:
			return
		case err == nil && !downSince.IsZero():
			h.log.Info("database reachable again; jobs, the outbox, the inbox and tasks resume",
				"outage_ms", time.Since(downSince).Milliseconds())
			downSince = time.Time{}
		case err != nil && downSince.IsZero():
			downSince = time.Now()
			h.log.Error("database unreachable; jobs, the outbox, the inbox and tasks wait for it and resume by themselves when it answers",
				"error.code", obs.CodeDatabaseUnavailable, "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (h *dbHealth) ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, dbPingTimeout)
	defer cancel()
	return h.pool.Ping(ctx)
}
