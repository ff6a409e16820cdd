package outbox

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pglisten"
)

// listener keeps a dedicated connection LISTENing on NotifyChannel and wakes
// the loops on every notification. It is only an accelerator: the loops poll
// anyway, so while it reconnects events are late by at most poll_interval.
// LISTEN needs a session, so behind a transaction-mode pooler point the
// worker at PostgreSQL directly or accept polling latency.
//
// The same session holds the relay's marker and watches the other relays'
// (marker.go), so it lasts until the relay has stopped: while detached
// publishes finish after claiming stopped, the marker must stay.
//
// Its goroutine (run, and the hooks pglisten calls on it) alone touches
// watch; the claimers read marker through marker's own mutex; looks is
// atomic.
type listener struct {
	pool            *pgxpool.Pool
	inFlightTimeout time.Duration
	log             *slog.Logger
	wake            func() // tells every loop to look again

	marker marker       // this relay's, as its detaches name it (marker.go)
	watch  *markerWatch // the listener session's view of the markers
	looks  atomic.Int64 // looks at the markers that succeeded
}

func newListener(pool *pgxpool.Pool, inFlightTimeout time.Duration, log *slog.Logger, wake func()) *listener {
	return &listener{pool: pool, inFlightTimeout: inFlightTimeout, log: log, wake: wake}
}

// run listens until ctx ends.
func (l *listener) run(ctx context.Context) {
	cfg := l.pool.Config().ConnConfig
	cfg.RuntimeParams["application_name"] = "outbox-listener"
	pl := pglisten.Listener{Name: "outbox listener", Config: cfg, Channel: NotifyChannel, Log: l.log,
		Fallback: "relays poll every outbox.poll_interval", Hooks: l.markerHooks()}
	// Rows inserted while nobody listened woke nobody: wake on connect.
	pl.Run(ctx, l.wake, func(string) { l.wake() })
}
