package startup

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/jobs"
	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/outbox"
)

// Housekeeping cadence. Both jobs delete in bounded chunks.
const (
	lockReaperName = "lock-reaper"
	leasePoolConns = 2 // lease statements are single short statements
	lockReapDelay  = time.Hour
	lockReapAfter  = 24 * time.Hour // lease rows expired this long ago
	// outboxPartitionsDelay is the longest pause of the partition keeper:
	// a missed run costs nothing while partitions_ahead covers days.
	outboxPartitionsDelay = time.Minute
)

// wire builds the worker's components: the job scheduler and, when enabled,
// the outbox relay. cleanup runs after they have stopped.
func wire(ctx context.Context, cfg *runConfig, pool *pgxpool.Pool, log *slog.Logger, reg prometheus.Registerer, stdout io.Writer) (parts []component, cleanup func(), err error) {
	cleanup = func() {}
	var (
		locker lock.Locker
		specs  = jobs.Builtin(pool)
	)
	if cfg.ext.Jobs != nil {
		specs = append(specs, cfg.ext.Jobs(pool)...)
	}
	switch cfg.Lock.Provider {
	case config.ProviderPostgres:
		// Leases get a pool of their own: a renewal must never wait for a
		// connection behind the work it protects (SQL jobs hold theirs for
		// the whole run), or a busy pool would cost every running job its
		// lease.
		lcfg := pool.Config()
		lcfg.MaxConns = leasePoolConns
		lcfg.MinConns, lcfg.MinIdleConns = 0, 0
		lcfg.ConnConfig.RuntimeParams["application_name"] = "worker " + cfg.Instance.ID + " leases"
		leasePool, err := pgxpool.NewWithConfig(context.Background(), lcfg)
		if err != nil {
			return nil, cleanup, err
		}
		pg, err := lock.NewPostgres(leasePool, cfg.Instance.ID, log)
		if err != nil {
			leasePool.Close()
			return nil, cleanup, err
		}
		cleanup = func() {
			pg.Close()
			// Bounded like the main pool: a lease statement stuck on a hung
			// database (a renewal of a job that ignored cancellation, a
			// release past the budget) must not hold the exit.
			closeBounded(leasePool, time.Second, log)
		}
		locker = pg
		specs = append(specs, jobs.Spec{
			Job: jobs.Func(lockReaperName, func(ctx context.Context) error {
				_, err := pg.Reap(ctx, lockReapAfter)
				return err
			}),
			Delay: lockReapDelay,
		})
	case config.ProviderRedis:
		rl, closeRedis, err := newRedisLocker(ctx, cfg, log)
		if err != nil {
			return nil, cleanup, err
		}
		cleanup, locker = closeRedis, rl
	default:
		locker = lock.NewInProcess(cfg.Instance.ID, log)
	}
	// Started first and stopped with the rest: while the provider's store
	// does not answer, it reports the outage once and keeps the replica
	// not ready (docs/lock.md, "When the provider is unreachable").
	health, err := lock.NewHealth(locker, cfg.Lock.LeaseTTL, reg, log)
	if err != nil {
		return nil, cleanup, err
	}
	parts = append(parts, health)
	if locker, err = lock.WithMetrics(locker, reg); err != nil {
		return nil, cleanup, err
	}

	if cfg.Outbox.Enabled {
		sink, err := newSink(ctx, cfg, stdout, log)
		if err != nil {
			return nil, cleanup, err
		}
		relay, err := outbox.NewRelay(pool, outbox.Traced(sink), cfg.Outbox, cfg.Instance.ID, log, reg)
		if err != nil {
			if c, ok := sink.(closer); ok {
				_ = c.Close(ctx)
			}
			return nil, cleanup, err
		}
		parts = append(parts, sinkRelay{Relay: relay, sink: sink})
	}
	if cfg.Tasks.Enabled {
		rt, err := newTaskRuntime(cfg, pool, log, reg)
		if err != nil {
			return nil, cleanup, err
		}
		parts = append(parts, rt)
	}
	in, err := newInbox(cfg, pool, log, reg)
	if err != nil {
		return nil, cleanup, err
	}
	if in != nil {
		parts = append(parts, in)
	}
	// The partition keeper runs even where the relay is off: producers
	// need partitions, and retention is a property of the table, not of
	// this replica.
	specs = append(specs, jobs.Spec{
		Job: &outbox.Partitions{Pool: pool, Interval: cfg.Outbox.PartitionInterval,
			Ahead: cfg.Outbox.PartitionsAhead, Retention: cfg.Outbox.Retention, Log: log},
		// Several runs per partition, so the last partition ahead is
		// replaced long before the clock reaches it.
		Delay: min(outboxPartitionsDelay, cfg.Outbox.PartitionInterval/4),
	})

	configured, err := jobs.FromDefinitions(cfg.Jobs, pool, nil)
	if err != nil {
		return nil, cleanup, config.Errorf("%w", err)
	}
	sched, err := jobs.New(jobs.Options{
		Pool:          pool,
		Locker:        locker,
		InstanceID:    cfg.Instance.ID,
		MaxConcurrent: cfg.AsyncExecutor.MaxSize,
		LeaseTTL:      cfg.Lock.LeaseTTL,
		AcquireWait:   cfg.Lock.WaitTime,
		Logger:        log,
		Registerer:    reg,
	}, append(specs, configured...)...)
	if err != nil {
		return nil, cleanup, fmt.Errorf("jobs: %w", err)
	}
	return append(parts, sched), cleanup, nil
}
