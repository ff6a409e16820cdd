package lock

import (
	"context"

	"github.com/worker-dev/worker/internal/pglisten"
)

// listen keeps one dedicated connection LISTENing on notifyChannel and fans
// each notification out to the local waiters of its key. It reconnects
// with backoff; while it is down, waiters still make progress by polling.
//
// LISTEN is session state, but only an optimization: a lost notification
// costs latency (one poll interval), never correctness.
func (p *Postgres) listen(ctx context.Context) {
	defer close(p.done)
	l := pglisten.Listener{Name: "lock listener", Config: p.pool.Config().ConnConfig, Channel: notifyChannel,
		Log: p.log.With("owner", p.owner), Fallback: "waiters fall back to polling"}
	l.Run(ctx, func() {
		p.connects.Add(1)
		p.room.wakeAll() // a release may have gone by unheard
	}, p.room.wake)
}
