package jobs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/lock"
)

// Options configures a Scheduler.
type Options struct {
	// Pool holds job_state, the cluster-wide record of every job's runs.
	// Required in single-instance mode too: one code path for both.
	Pool *pgxpool.Pool
	// Locker grants lease job:<name> for every run: the postgres provider
	// with APP_MULTI_INSTANCE_ENABLED=true, the in-process one otherwise.
	Locker lock.Locker
	// InstanceID names this replica in job_state.last_instance.
	InstanceID string
	// MaxConcurrent bounds the jobs running at once on this replica
	// (APP_ASYNC_EXECUTOR_MAX_SIZE). Default 10.
	MaxConcurrent int
	// LeaseTTL is the lease ttl of jobs that set none (APP_LOCK_LEASE_TTL).
	// Default 30s.
	LeaseTTL time.Duration
	// CheckPeriod is how often this replica re-checks a job that may be due.
	// It bounds how late a run can start after its due time, so keep it well
	// under a second. Default 500ms; a job's own period is min(delay, this).
	CheckPeriod time.Duration
	// AcquireWait is how long one attempt waits for a job's lease. Short:
	// a held lease means another replica is running or about to run the
	// job, and skipping is correct. Default 100ms. (0 while this replica
	// only watches another's run.)
	AcquireWait time.Duration
	Logger      *slog.Logger
	// Registerer receives the job and executor metrics and the gocron
	// adapter's lock_unlock_errors_total; nil means a throwaway registry.
	Registerer prometheus.Registerer
}

const (
	defaultMaxConcurrent = 10
	defaultLeaseTTL      = 30 * time.Second
	defaultCheckPeriod   = 500 * time.Millisecond
	defaultAcquireWait   = 100 * time.Millisecond
	// stateTimeout bounds the state write made after a run; it runs even
	// when the run was cancelled. (The adapter bounds the release alike.)
	stateTimeout = 5 * time.Second
	// cancelGrace is how long Shutdown waits for cancelled runs to return.
	cancelGrace = 500 * time.Millisecond
)

// Scheduler runs jobs on a fixed delay. See docs/jobs.md for the design.
type Scheduler struct {
	opts    Options
	log     *slog.Logger
	m       *metrics
	st      store
	entries []*entry
	byName  map[string]*entry
	gl      *lock.GocronLocker // takes job:<name> for gocron and hands it to the run
	gs      gocron.Scheduler
	sem     chan struct{} // one token per running job

	mu       sync.Mutex
	started  bool
	stopping bool
	inflight sync.WaitGroup // attempts from Lock to Unlock; Add only under mu while !stopping
	stopCh   chan struct{}  // closed when Shutdown begins

	// base parents every run; Shutdown cancels it (cause errShutdown) when
	// its budget runs out. It is detached from Start's ctx on purpose: the
	// caller cancels that one on SIGTERM, and in-flight runs must be allowed
	// to finish.
	base       context.Context
	cancelBase context.CancelCauseFunc
}

// entry is one job's runtime state on this replica.
type entry struct {
	spec   Spec
	name   string
	period time.Duration // how often this replica's timer fires
	busy   atomic.Bool   // an attempt is in progress (from Lock to Unlock)
	run    atomic.Bool   // the job body is executing

	// Touched only by the job's own attempt (Lock, the AfterLockError
	// listener, the run), which never overlaps itself: gocron's singleton
	// runner makes these calls one after another on one goroutine.
	nextCheck time.Time // before this, the job cannot be due: skip the lock and the database
	watching  bool      // another replica holds the lease; skipped_locked counted once
}

// New validates the specs and prepares the scheduler; Start starts it.
func New(opts Options, specs ...Spec) (*Scheduler, error) {
	if opts.Pool == nil || opts.Locker == nil || opts.InstanceID == "" {
		return nil, errors.New("jobs: Options.Pool, Options.Locker and Options.InstanceID are required")
	}
	if opts.MaxConcurrent <= 0 {
		opts.MaxConcurrent = defaultMaxConcurrent
	}
	if opts.LeaseTTL <= 0 {
		opts.LeaseTTL = defaultLeaseTTL
	}
	if opts.CheckPeriod <= 0 {
		opts.CheckPeriod = defaultCheckPeriod
	}
	if opts.AcquireWait <= 0 {
		opts.AcquireWait = defaultAcquireWait
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Registerer == nil {
		opts.Registerer = prometheus.NewRegistry()
	}
	entries, err := prepare(opts, specs)
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(opts.Registerer, entries)
	if err != nil {
		return nil, fmt.Errorf("jobs: metrics: %w", err)
	}
	s := &Scheduler{
		opts: opts, log: opts.Logger, m: m, st: store{opts.Pool}, entries: entries,
		byName: make(map[string]*entry, len(entries)),
		sem:    make(chan struct{}, opts.MaxConcurrent), stopCh: make(chan struct{}),
	}
	for _, e := range entries {
		s.byName[e.name] = e
	}
	s.gl, err = lock.NewGocronLocker(opts.Locker, lock.GocronConfig{
		// While watching another replica's run, waiting is pointless: the
		// probe only looks for a holder that died.
		Wait: func(name string) time.Duration {
			if s.byName[name].watching {
				return 0
			}
			return opts.AcquireWait
		},
		TTL: func(name string) time.Duration { return s.byName[name].spec.LeaseTTL },
	}, opts.Registerer, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("jobs: gocron locker: %w", err)
	}
	s.gs, err = gocron.NewScheduler(gocron.WithMonitor(overlapMonitor{m}), gocron.WithStopTimeout(time.Second))
	if err != nil {
		return nil, fmt.Errorf("jobs: %w", err)
	}
	for _, e := range entries {
		// The timer is a per-replica "check again" tick, not the cadence:
		// the cadence is enforced cluster-wide from job_state under the
		// lease (see attempt). Interval-from-completion and singleton mode
		// still matter: a replica never starts a second attempt of a job
		// while one is in progress, and the tick after a run comes only
		// after the run ended. The name is the lock key, so it is required.
		_, err := s.gs.NewJob(gocron.DurationJob(e.period), gocron.NewTask(s.attempt, e),
			gocron.WithName(e.name),
			gocron.WithIntervalFromCompletion(),
			gocron.WithSingletonMode(gocron.LimitModeReschedule),
			gocron.WithStartAt(gocron.WithStartImmediately()),
			gocron.WithDistributedJobLocker(gate{s}),
			gocron.WithEventListeners(gocron.AfterLockError(s.lockFailed)))
		if err != nil {
			_ = s.gs.Shutdown()
			return nil, fmt.Errorf("jobs: schedule %q: %w", e.name, err)
		}
	}
	return s, nil
}

// CheckSpecs reports every mistake in specs that New would refuse (names,
// delays), without building anything: for Go jobs, checked before the
// worker connects to anything.
func CheckSpecs(specs ...Spec) error {
	_, err := prepare(Options{}, specs)
	return err
}

func prepare(opts Options, specs []Spec) ([]*entry, error) {
	var errs []error
	seen := map[string]bool{}
	var entries []*entry
	for i, sp := range specs {
		if sp.Job == nil {
			errs = append(errs, fmt.Errorf("jobs: spec %d has no Job", i))
			continue
		}
		name := sp.Job.Name()
		bad := func(format string, args ...any) {
			errs = append(errs, fmt.Errorf("jobs: job %q: %s", name, fmt.Sprintf(format, args...)))
		}
		switch {
		case !jobsconfig.ValidName(name):
			bad("name not allowed; want 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
		case seen[name]:
			bad("registered twice; every job needs a unique name (it is the lock key)")
		}
		seen[name] = true
		if sp.Delay <= 0 {
			bad("delay is %s; want a positive duration", sp.Delay)
		}
		if sp.InitialDelay < 0 || sp.Timeout < 0 || sp.LeaseTTL < 0 {
			bad("initial delay, timeout and lease ttl must not be negative")
		}
		if sp.Timeout == 0 {
			sp.Timeout = jobsconfig.DefaultTimeout
		}
		if sp.LeaseTTL == 0 {
			sp.LeaseTTL = opts.LeaseTTL
		}
		entries = append(entries, &entry{spec: sp, name: name, period: min(sp.Delay, opts.CheckPeriod)})
	}
	return entries, errors.Join(errs...)
}

// Start records every job in job_state and starts the timers. ctx bounds
// only that setup; runs live until Shutdown.
func (s *Scheduler) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started || s.stopping {
		return errors.New("jobs: scheduler already started or stopped")
	}
	// Bounded: the worker starts components on a context that SIGTERM does
	// not cancel, so a hung database must not hold the start forever.
	rctx, cancel := context.WithTimeout(ctx, stateTimeout)
	defer cancel()
	for _, e := range s.entries {
		if err := s.st.register(rctx, e.name, e.spec.Delay); err != nil {
			return fmt.Errorf("jobs: register %q in job_state: %w", e.name, err)
		}
	}
	now := time.Now()
	for _, e := range s.entries {
		e.nextCheck = now.Add(e.spec.InitialDelay)
	}
	s.base, s.cancelBase = context.WithCancelCause(context.WithoutCancel(ctx))
	s.started = true
	s.gs.Start()
	s.log.Info("job scheduler started", "jobs", len(s.entries), "max_concurrent", s.opts.MaxConcurrent)
	return nil
}

var errShutdown = errors.New("worker shutting down")

// Shutdown stops starting runs at once, lets running jobs finish until
// ctx's deadline, then cancels them and waits briefly for them to return.
// Each run records its end and releases its lease itself, after its own
// transaction committed, with a context that outlives the cancellation.
// It returns an error only if some job ignored the cancellation.
func (s *Scheduler) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if !s.started || s.stopping {
		first := !s.stopping
		s.stopping = true
		s.mu.Unlock()
		if first {
			return s.gs.Shutdown() // never started: only gocron's own goroutines to stop
		}
		return nil
	}
	s.stopping = true
	close(s.stopCh)
	s.mu.Unlock()

	idle := make(chan struct{})
	go func() { s.inflight.Wait(); close(idle) }()
	var err error
	select {
	case <-idle:
	case <-ctx.Done():
		s.log.Warn("shutdown budget spent; cancelling running jobs", "jobs", s.runningNames())
		s.cancelBase(errShutdown)
		select {
		case <-idle:
		case <-time.After(cancelGrace):
			err = fmt.Errorf("jobs: %s still running %s after cancellation; their leases expire after their ttl",
				s.runningNames(), cancelGrace)
		}
	}
	s.cancelBase(errShutdown)
	// Every attempt has returned and released its lease (or is stuck in a
	// job), so gocron only has timers left to stop.
	gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	if gerr := s.gs.ShutdownWithContext(gctx); gerr != nil && err == nil {
		err = fmt.Errorf("jobs: stop timers: %w", gerr)
	}
	return err
}

func (s *Scheduler) runningNames() string {
	var names []string
	for _, e := range s.entries {
		if e.run.Load() {
			names = append(names, e.name)
		}
	}
	return "[" + strings.Join(names, " ") + "]"
}

// enter registers an attempt unless shutdown has begun.
func (s *Scheduler) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		return false
	}
	s.inflight.Add(1)
	return true
}

// leave ends an attempt that enter registered.
func (s *Scheduler) leave(e *entry) {
	e.busy.Store(false)
	s.inflight.Done()
}
