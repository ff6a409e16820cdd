package startup

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"worker/internal/obs"
)

// UnavailableError is a dependency that stayed unreachable: exit 69.
type UnavailableError struct{ Msg string }

func (e *UnavailableError) Error() string { return e.Msg }

// connectDB opens the pool and waits, with exponential backoff, until the
// database answers or cfg.Database.ConnectTimeout has passed. The error never
// carries the password.
func connectDB(ctx context.Context, cfg *Config, log *slog.Logger) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.Database.URL)
	if err != nil {
		return nil, configErrorf("database.url: %s", obs.MaskDSN(err.Error()))
	}
	pcfg.MaxConns = int32(cfg.Database.MaxConns)
	pcfg.ConnConfig.RuntimeParams["application_name"] = "worker " + cfg.Instance.ID
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, configErrorf("database.url: %s", obs.MaskDSN(err.Error()))
	}
	start := time.Now()
	_, err = backoff.Retry(ctx, func() (struct{}, error) {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		err := pool.Ping(pctx)
		if err != nil {
			log.Warn("database not reachable yet, retrying", "error", err, "elapsed_ms", time.Since(start).Milliseconds())
		}
		return struct{}{}, err
	}, backoff.WithBackOff(&backoff.ExponentialBackOff{
		InitialInterval:     100 * time.Millisecond,
		RandomizationFactor: 0.2,
		Multiplier:          2,
		MaxInterval:         3 * time.Second,
	}), backoff.WithMaxElapsedTime(cfg.Database.ConnectTimeout))
	if err != nil {
		pool.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &UnavailableError{Msg: fmt.Sprintf("database %s unreachable after %s (APP_DATABASE_CONNECT_TIMEOUT): %s",
			obs.MaskDSN(cfg.Database.URL), cfg.Database.ConnectTimeout, obs.MaskDSN(err.Error()))}
	}
	return pool, nil
}
