package startup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/obs"
)

// redisLeaseConns bounds the lease client's pool: lease scripts are single
// short commands. The release subscription holds one more connection.
const redisLeaseConns = 4

// redisOptions turns lock.redis into the client's options; errors name
// the key and never show the password.
func redisOptions(c config.RedisLockConfig, instanceID string) (*redis.Options, error) {
	o, err := redis.ParseURL(c.URL)
	if err != nil {
		return nil, fmt.Errorf("lock.redis.url=%q is not a Redis URL (want redis:// or rediss://host:port/db): %s",
			obs.MaskDSN(c.URL), obs.MaskDSN(err.Error()))
	}
	tlsFiles := c.TLSCAFile != "" || c.TLSCertFile != "" || c.TLSKeyFile != ""
	switch {
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return nil, errors.New("lock.redis.tls_cert_file and lock.redis.tls_key_file: set both for a client certificate, or neither")
	case tlsFiles && o.TLSConfig == nil:
		return nil, fmt.Errorf("lock.redis.tls_* files are set but lock.redis.url=%q is not rediss://; use rediss:// for TLS", obs.MaskDSN(c.URL))
	case o.TLSConfig != nil:
		tc, err := broker.TLSConfig("lock.redis", c.TLSCAFile, c.TLSCertFile, c.TLSKeyFile)
		if err != nil {
			return nil, err
		}
		tc.ServerName = o.TLSConfig.ServerName
		o.TLSConfig = tc
	}
	// Deadlines must reach the socket: an acquire on a hung server is
	// bounded like a database statement.
	o.ContextTimeoutEnabled = true
	// The lease machinery retries by itself (the heartbeat within the ttl,
	// the caller for acquire and release); a client retry could run a
	// script twice and misreport the second run (a release that already
	// happened, an acquire that finds its own grant held).
	o.MaxRetries = -1
	o.PoolSize = redisLeaseConns
	o.ClientName = "worker-" + strings.Map(func(r rune) rune {
		if r <= ' ' {
			return '-'
		}
		return r
	}, instanceID)
	return o, nil
}

// newRedisLocker connects to lock.redis.url, waiting for it like the
// database (database.connect_timeout), and returns the provider and what
// closes it.
func newRedisLocker(ctx context.Context, cfg *runConfig, log *slog.Logger) (*lock.Redis, func(), error) {
	o, err := redisOptions(cfg.Lock.Redis, cfg.Instance.ID)
	if err != nil {
		return nil, nil, config.Errorf("%v", err)
	}
	// go-redis logs through a package logger of its own (plain text on
	// stderr); route it through ours, masked, as JSON.
	redis.SetLogger(redisLog{log.With("component", "redis client")})
	rdb := redis.NewClient(o)
	if err := waitForRedis(ctx, rdb, cfg, log); err != nil {
		_ = rdb.Close()
		return nil, nil, err
	}
	rl, err := lock.NewRedis(rdb, cfg.Lock.Redis.KeyPrefix, cfg.Instance.ID, log)
	if err != nil {
		_ = rdb.Close()
		return nil, nil, err
	}
	return rl, func() {
		rl.Close()
		_ = rdb.Close()
	}, nil
}

// waitForRedis pings until Redis answers, a permanent error comes back, or
// the connect budget is spent, as waitForDB does for the database.
func waitForRedis(ctx context.Context, rdb *redis.Client, cfg *runConfig, log *slog.Logger) error {
	shown := obs.MaskDSN(cfg.Lock.Redis.URL)
	return waitFor(ctx, dependency{
		name:      "redis",
		shown:     shown,
		ping:      func(ctx context.Context) error { return rdb.Ping(ctx).Err() },
		permanent: func(err error) error { return permanentRedisError(err, shown) },
	}, cfg.Database.ConnectTimeout, log)
}

// permanentRedisError classifies what no retry can fix: refused
// credentials or permissions (exit 77, like the database's), a database
// number the server does not have, and TLS that cannot work (exit 78).
// It returns nil for everything else.
func permanentRedisError(err error, shown string) error {
	for _, prefix := range []string{"WRONGPASS", "NOAUTH", "NOPERM", "AUTH"} {
		if redis.HasErrorPrefix(err, prefix) {
			return &ExitError{Code: ExitNoPerm, Err: err, Msg: fmt.Sprintf("redis %s (APP_LOCK_REDIS_URL): authentication refused: %s",
				shown, obs.MaskDSN(err.Error()))}
		}
	}
	if redis.HasErrorPrefix(err, "DB index is out of range") {
		return &config.Error{Err: err, Msg: fmt.Sprintf("redis %s (APP_LOCK_REDIS_URL): the server has no such database number: %s",
			shown, obs.MaskDSN(err.Error()))}
	}
	if tlsErr := broker.TLSVerdict("lock.redis", err); tlsErr != nil {
		if errors.Is(tlsErr, broker.ErrRefused) {
			return &ExitError{Code: ExitNoPerm, Err: tlsErr, Msg: fmt.Sprintf("redis %s: %s", shown, obs.MaskDSN(tlsErr.Error()))}
		}
		return &config.Error{Err: tlsErr, Msg: fmt.Sprintf("redis %s: %s", shown, obs.MaskDSN(tlsErr.Error()))}
	}
	return nil
}

// redisLog is go-redis's logger interface over the worker's logger.
type redisLog struct{ log *slog.Logger }

func (l redisLog) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, fmt.Sprintf(format, v...))
}
