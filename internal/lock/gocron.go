package lock

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
)

// unlockTimeout bounds the release gocron asks for after a run. It runs on
// a context detached from the job's (which is cancelled at shutdown), so it
// needs its own bound.
const unlockTimeout = 5 * time.Second

// JobKey is the lease key of a scheduled job: "job:<name>".
func JobKey(job string) string { return "job:" + job }

// GocronConfig configures the gocron adapter.
type GocronConfig struct {
	// Wait returns how long this attempt waits for a job's lease before
	// gocron skips the run. nil means a single try, which suits scheduled
	// jobs: another replica is running the job, so this one has nothing to
	// do. A function, because the caller may know that a wait is pointless
	// right now (it watches another replica's run only for a crash).
	Wait func(job string) time.Duration
	// TTL returns the lease ttl of a job (its lease_ttl). Required.
	TTL func(job string) time.Duration
}

// GocronLocker adapts a Locker to gocron.Locker. gocron passes the job
// name; the lease key is JobKey(name). Install it with
// gocron.WithDistributedJobLocker (or WithDistributedLocker); internal/jobs
// does, behind a gate of its own.
//
// gocron's job function does not receive the lock, so the adapter records
// the lease of each running job: the job body calls Lease(name) to read the
// fencing token and watch Lost (see WithLease). gocron calls the job
// function only after Lock succeeded and Unlock only after it returned, so
// the lease is recorded for the whole body.
type GocronLocker struct {
	locker       Locker
	cfg          GocronConfig
	log          *slog.Logger
	unlockErrors prometheus.Counter

	mu      sync.Mutex
	active  map[string]Lease    // job name -> lease of its current run
	failing map[string]struct{} // jobs whose last attempt failed on the store
}

var _ gocron.Locker = (*GocronLocker)(nil)

// NewGocronLocker returns the adapter. It registers lock_unlock_errors_total
// on reg, because gocron discards Unlock errors. log may be nil.
func NewGocronLocker(l Locker, cfg GocronConfig, reg prometheus.Registerer, log *slog.Logger) (*GocronLocker, error) {
	if cfg.TTL == nil {
		return nil, errors.New("lock: GocronConfig.TTL is required")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "lock_unlock_errors_total",
		Help: "Job lease releases that failed or found the lease expired (gocron itself ignores them).",
	})
	if err := reg.Register(c); err != nil {
		return nil, err
	}
	return &GocronLocker{locker: l, cfg: cfg, log: log, unlockErrors: c, active: map[string]Lease{}, failing: map[string]struct{}{}}, nil
}

// Lock implements gocron.Locker. An error makes gocron skip the run and
// call the job's AfterLockError listener with it.
func (g *GocronLocker) Lock(ctx context.Context, job string) (gocron.Lock, error) {
	key := JobKey(job)
	var wait time.Duration
	if g.cfg.Wait != nil {
		wait = g.cfg.Wait(job)
	}
	lease, err := g.locker.TryAcquire(ctx, key, wait, g.cfg.TTL(job))
	if err != nil {
		// A timeout (another replica holds the job) is the normal case, not
		// a fault: it is not logged here, where it would repeat on every
		// tick, but left to the caller's AfterLockError listener.
		// A cancelled ctx is the scheduler stopping, not a fault. During an
		// outage the scheduler retries every second: the first failure of
		// each job is a WARN, the rest DEBUG (Health logs the outage).
		if !IsTimeout(err) && ctx.Err() == nil {
			g.mu.Lock()
			_, again := g.failing[job]
			g.failing[job] = struct{}{}
			g.mu.Unlock()
			level := slog.LevelWarn
			if again {
				level = slog.LevelDebug
			}
			g.log.Log(ctx, level, "job lease not acquired; skipping run", append([]any{"job", job, "key", key}, obs.ErrorAttrs(err)...)...)
		}
		return nil, err
	}
	g.mu.Lock()
	g.active[job] = lease
	delete(g.failing, job)
	g.mu.Unlock()
	return &gocronLock{g: g, job: job, lease: lease}, nil
}

// Lease returns the lease of job's current run, if this replica runs it.
func (g *GocronLocker) Lease(job string) (Lease, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.active[job]
	return l, ok
}

type gocronLock struct {
	g     *GocronLocker
	job   string
	lease Lease
}

// Unlock implements gocron.Lock. It releases on a context detached from
// ctx: gocron passes the job's context, which shutdown has cancelled by the
// time the last runs finish, and their leases must still be handed back.
func (l *gocronLock) Unlock(ctx context.Context) error {
	l.g.mu.Lock()
	if l.g.active[l.job] == l.lease {
		delete(l.g.active, l.job)
	}
	l.g.mu.Unlock()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), unlockTimeout)
	defer cancel()
	err := l.lease.Release(rctx)
	if err != nil {
		l.g.unlockErrors.Inc()
		l.g.log.Warn("job lease release failed", "job", l.job, "key", l.lease.Key(),
			"token", l.lease.Token(), "error", err)
	}
	return err
}
