// Package pglisten runs one LISTEN session on a dedicated connection, for
// the wake-ups that the lock provider and the outbox relay take from
// NOTIFY. Callers loop over Session with their own backoff; a lost
// notification costs them latency, never correctness.
package pglisten

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultIdle is how long a session waits for a notification before it
// checks that its connection is still alive.
const DefaultIdle = 15 * time.Second

// connectTimeout bounds the connect and the LISTEN statement.
const connectTimeout = 10 * time.Second

// Session connects with cfg (outside any pool, so it never takes a slot
// that statements need), LISTENs on channel, calls connected, then calls
// notify with each notification's payload, until ctx ends or the
// connection fails. It reports whether the LISTEN succeeded, and why the
// session ended.
//
// A connection can die silently: after a failover without a TCP reset the
// socket stays open and simply never delivers again, and TCP keepalive
// notices only after minutes. So when no notification came for idle, the
// session pings the server (bounded by idle too) and ends if it does not
// answer: a dead connection is noticed within twice idle.
func Session(ctx context.Context, cfg *pgx.ConnConfig, channel string, idle time.Duration,
	connected func(), notify func(payload string)) (listening bool, err error) {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(cctx, cfg)
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if _, err := conn.Exec(cctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	connected()
	for {
		// A wait that times out leaves the connection usable: pgx keeps a
		// read deadline error from closing it.
		wctx, cancel := context.WithTimeout(ctx, idle)
		n, err := conn.WaitForNotification(wctx)
		timedOut := wctx.Err() != nil
		cancel()
		switch {
		case err == nil:
			notify(n.Payload)
		case ctx.Err() != nil:
			return true, ctx.Err()
		case !timedOut:
			return true, err
		default:
			pctx, cancel := context.WithTimeout(ctx, idle)
			err := conn.Ping(pctx)
			cancel()
			if err != nil {
				return true, fmt.Errorf("no answer to a health check after %s without notifications: %w", idle, err)
			}
		}
	}
}
