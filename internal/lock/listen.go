package lock

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"

	"worker/internal/pglisten"
)

// listen keeps one dedicated connection LISTENing on notifyChannel and fans
// each notification out to the local waiters of its key. It reconnects
// with backoff; while it is down, waiters still make progress by polling.
//
// LISTEN is session state, but only an optimization: a lost notification
// costs latency (one poll interval), never correctness.
func (p *Postgres) listen(ctx context.Context) {
	defer close(p.done)
	retry := &backoff.ExponentialBackOff{
		InitialInterval: 100 * time.Millisecond, RandomizationFactor: 0.5,
		Multiplier: 2, MaxInterval: 5 * time.Second,
	}
	retry.Reset()
	for {
		connected, err := p.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if connected {
			retry.Reset()
		}
		p.log.Warn("lock listener disconnected; waiters fall back to polling until it reconnects",
			"owner", p.owner, "error", err)
		t := time.NewTimer(retry.NextBackOff())
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

func (p *Postgres) listenOnce(ctx context.Context) (connected bool, err error) {
	return pglisten.Session(ctx, p.pool.Config().ConnConfig, notifyChannel, pglisten.DefaultIdle,
		func() {
			p.connects.Add(1)
			p.wakeAll() // a release may have gone by unheard
		},
		p.wake)
}
