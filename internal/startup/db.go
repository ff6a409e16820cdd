package startup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/opsserver"
	"github.com/worker-dev/worker/internal/tasks"
	"github.com/worker-dev/worker/internal/tracing"
)

// Connect attempts: at most pingTimeout each, and at least lastPing for the
// one made when the budget runs out, so it can fail with the real cause
// rather than with our own deadline.
const (
	pingTimeout = 5 * time.Second
	lastPing    = time.Second
)

// MaxDBConns is the most connections a replica with this configuration
// holds at once, part by part as docs/operations.md "Connections" lists them: the main
// pool, the readiness probe's, the outbox and lock listeners, the lease
// pool, and River's pool with the LISTEN connection River keeps outside it.
func (c *runConfig) MaxDBConns() int {
	n := c.Database.MaxConns + opsserver.ProbePoolConns
	if c.Outbox.Enabled {
		n++ // the outbox listener
	}
	if c.Lock.Provider == config.ProviderPostgres {
		n += leasePoolConns + 1 // and the lock listener
	}
	if c.Tasks.Enabled {
		n += tasks.MaxConns
	}
	return n
}

// connectDB opens the pool and waits, with exponential backoff, until the
// database answers or cfg.Database.ConnectTimeout has passed. Refused
// credentials and an unknown database end the wait at once: they are not an
// outage. The error never carries the password.
func connectDB(ctx context.Context, cfg *runConfig, log *slog.Logger) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.Database.URL)
	if err != nil {
		return nil, config.Errorf("database.url: %s", obs.MaskDSN(err.Error()))
	}
	pcfg.MaxConns = int32(cfg.Database.MaxConns)
	pcfg.ConnConfig.RuntimeParams["application_name"] = "worker " + cfg.Instance.ID
	if cfg.Database.Trace {
		pcfg.ConnConfig.Tracer = tracing.DatabaseTracer{} // River's pool copies this configuration
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, config.Errorf("database.url: %s", obs.MaskDSN(err.Error()))
	}
	if err := waitForDB(ctx, pool, cfg, log); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// waitForDB pings until the database answers, a permanent error comes back,
// or the connect budget is spent.
func waitForDB(ctx context.Context, pool *pgxpool.Pool, cfg *runConfig, log *slog.Logger) error {
	return waitFor(ctx, dependency{
		name:      "database",
		shown:     obs.MaskDSN(cfg.Database.URL),
		ping:      pool.Ping,
		permanent: func(err error) error { return permanentDBError(err, cfg.Database.URL) },
	}, cfg.Database.ConnectTimeout, log)
}

// dependency is what waitFor needs to know of one the worker connects to
// at start.
type dependency struct {
	name      string // in errors and logs: "database", "redis"
	shown     string // its URL, credentials masked
	ping      func(context.Context) error
	permanent func(error) error // what no retry can fix, as the exit error; nil to retry
}

// waitFor pings d until it answers, a permanent error comes back, or the
// connect budget is spent (exit 69). The last attempt is made when the
// budget runs out, so the worker really keeps trying for the whole budget.
func waitFor(ctx context.Context, d dependency, budget time.Duration, log *slog.Logger) error {
	start := time.Now()
	deadline := start.Add(budget)
	wait := &backoff.ExponentialBackOff{
		InitialInterval:     100 * time.Millisecond,
		RandomizationFactor: 0.2,
		Multiplier:          2,
		MaxInterval:         3 * time.Second,
	}
	wait.Reset()
	for {
		limit := min(pingTimeout, max(time.Until(deadline), lastPing))
		pctx, cancel := context.WithTimeout(ctx, limit)
		err := d.ping(pctx)
		cancel()
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, context.DeadlineExceeded):
			// Our own bound, not the server's answer: say what it means
			// (a server that accepts connections but does not answer, or
			// packets dropped on the way), not just "context deadline
			// exceeded".
			err = fmt.Errorf("no answer within %s: %w", limit.Round(time.Millisecond), err)
		}
		if perr := d.permanent(err); perr != nil {
			return perr
		}
		remaining := time.Until(deadline)
		if remaining <= 0 {
			elapsed := time.Since(start).Round(100 * time.Millisecond)
			return &ExitError{Code: ExitUnavailable, Err: err, Msg: fmt.Sprintf("%s %s unreachable after %s (APP_DATABASE_CONNECT_TIMEOUT=%s): %s",
				d.name, d.shown, elapsed, budget, obs.MaskDSN(err.Error()))}
		}
		log.Warn(d.name+" not reachable yet, retrying", "error", err, "elapsed_ms", time.Since(start).Milliseconds())
		t := time.NewTimer(min(wait.NextBackOff(), remaining))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// permanentDBError classifies what no retry can fix: refused credentials
// (SQLSTATE class 28: wrong password, unknown role, no pg_hba entry) exit
// 77, and a database that does not exist (3D000) exits 66. It returns nil
// for everything else.
func permanentDBError(err error, url string) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return nil
	}
	shown := obs.MaskDSN(url)
	switch {
	case strings.HasPrefix(pgErr.Code, "28"):
		return &ExitError{Code: ExitNoPerm, Err: err, Msg: fmt.Sprintf("database %s: authentication failed for user %q (APP_DATABASE_URL): %s (SQLSTATE %s)",
			shown, userOf(url), obs.MaskDSN(pgErr.Message), pgErr.Code)}
	case pgErr.Code == "3D000":
		return &ExitError{Code: ExitNoInput, Err: err, Msg: fmt.Sprintf("database %s (APP_DATABASE_URL): %s; create it (createdb %s) or name another database in APP_DATABASE_URL",
			shown, obs.MaskDSN(pgErr.Message), databaseOf(url))}
	}
	return nil
}

// databaseOf is the database the URL names, as pgx resolves it.
func databaseOf(url string) string {
	c, err := pgconn.ParseConfig(url)
	if err != nil {
		return ""
	}
	return c.Database
}

// userOf is the role the URL connects as, as pgx resolves it (a default
// from PGUSER or the OS user when the URL names none).
func userOf(url string) string {
	c, err := pgconn.ParseConfig(url)
	if err != nil {
		return ""
	}
	return c.User
}
