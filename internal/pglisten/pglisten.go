// Package pglisten keeps a LISTEN session on a dedicated connection, for
// the wake-ups that the lock provider and the outbox relay take from
// NOTIFY. Run reconnects with backoff and logs each outage; a lost
// notification costs the callers latency, never correctness.
package pglisten

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"
)

// DefaultIdle is how long a session waits for a notification before it
// checks that its connection is still alive.
const DefaultIdle = 15 * time.Second

// connectTimeout bounds the connect and the LISTEN statement.
const connectTimeout = 10 * time.Second

// Listener describes a LISTEN session that Run keeps alive.
type Listener struct {
	Name    string // for log lines, e.g. "lock listener"
	Config  *pgx.ConnConfig
	Channel string
	Idle    time.Duration // DefaultIdle when 0
	Log     *slog.Logger  // discard when nil
	// Fallback tells the log reader what happens while disconnected, e.g.
	// "waiters fall back to polling".
	Fallback string
	Hooks    Hooks
}

// Hooks keep session state of the caller's on the listener's connection,
// such as a session-level advisory lock. All are optional.
type Hooks struct {
	// Setup runs on the connection once LISTEN succeeded, before
	// connected. Its error ends the session.
	Setup func(ctx context.Context, conn *pgx.Conn) error
	// Tick runs on the connection once connected has returned, then every
	// Every, between waits for notifications. Its error ends the session. With a Tick the session
	// does not ping the server after idle: Tick is its health check, and
	// bounds its own statements.
	Tick  func(ctx context.Context, conn *pgx.Conn) error
	Every time.Duration
	// Ended runs when a session whose Setup returned nil ends, before its
	// connection is closed.
	Ended func()
}

// Run keeps a session on l.Channel until ctx ends: it calls connected each
// time LISTEN succeeds (notifications sent while disconnected are lost, so
// callers re-check there) and notify with each payload. After a session
// ends it logs "disconnected" and reconnects with backoff; when LISTEN
// succeeds again it logs "reconnected" with how long it was down.
func (l Listener) Run(ctx context.Context, connected func(), notify func(payload string)) {
	log := l.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	idle := l.Idle
	if idle <= 0 {
		idle = DefaultIdle
	}
	retry := &backoff.ExponentialBackOff{
		InitialInterval: 100 * time.Millisecond, RandomizationFactor: 0.5,
		Multiplier: 2, MaxInterval: 5 * time.Second,
	}
	retry.Reset()
	var downSince time.Time // zero while connected, and before the first session
	for ctx.Err() == nil {
		listening, err := runSession(ctx, l.Config, l.Channel, idle, l.Hooks, func() {
			if !downSince.IsZero() {
				log.Info(l.Name+" reconnected", "channel", l.Channel,
					"down_for", time.Since(downSince).Round(time.Millisecond).String())
				downSince = time.Time{}
			}
			connected()
		}, notify)
		if ctx.Err() != nil {
			return
		}
		if listening {
			retry.Reset()
		}
		if downSince.IsZero() {
			downSince = time.Now()
		}
		d := retry.NextBackOff()
		log.Warn(l.Name+" disconnected; "+l.Fallback+" until it reconnects", "channel", l.Channel,
			"error", err, "retry_in", d.Round(time.Millisecond).String())
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

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
	return runSession(ctx, cfg, channel, idle, Hooks{}, connected, notify)
}

func runSession(ctx context.Context, cfg *pgx.ConnConfig, channel string, idle time.Duration, h Hooks,
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
	if h.Setup != nil {
		if err := h.Setup(ctx, conn); err != nil {
			return true, fmt.Errorf("setup: %w", err)
		}
		if h.Ended != nil {
			defer h.Ended() // deferred after the close above: runs first
		}
	}
	connected()
	nextTick := time.Now() // the first Tick at once

	for {
		if h.Tick != nil && !time.Now().Before(nextTick) {
			if err := h.Tick(ctx, conn); err != nil {
				if ctx.Err() != nil {
					return true, ctx.Err()
				}
				return true, err
			}
			nextTick = time.Now().Add(h.Every)
		}
		wait := idle
		if h.Tick != nil {
			wait = max(time.Until(nextTick), time.Millisecond)
		}
		// A wait that times out leaves the connection usable: pgx keeps a
		// read deadline error from closing it.
		wctx, cancel := context.WithTimeout(ctx, wait)
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
		case h.Tick != nil:
			// Tick is the health check.
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
