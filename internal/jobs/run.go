package jobs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/google/uuid"

	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/obs"
)

// How one attempt runs. gocron drives it; the lease is gocron's
// (WithDistributedJobLocker), taken through lock.GocronLocker; the cadence is
// the database's (job_state). Per tick of a job's gocron timer:
//
//  1. gate.Lock (gocron's locker call) admits the attempt unless shutdown
//     began, returns errNotDue without any statement while this replica
//     knows the job cannot be due yet, and otherwise takes lease job:<name>
//     through the adapter.
//  2. If that fails, gocron skips the run and calls lockFailed
//     (AfterLockError): a held lease is counted as skipped_locked, quietly.
//  3. Otherwise gocron calls attempt, under the lease. attempt finds the
//     lease in the adapter, puts its fencing token in the run's context
//     (FencingToken) and lets its Lost channel cancel that context, checks
//     job_state and runs the job if it is due, recording its start and end.
//  4. gocron calls Unlock after attempt returned: after the job's own
//     transaction committed and its end was recorded. The adapter releases
//     on a context detached from gocron's (cancelled at shutdown), and logs
//     and counts failures, which gocron drops. Only then does the attempt
//     end for Shutdown, which waits for it.
//
// After a failed Lock, gocron re-arms from this replica's own last
// completion (gocron #841). That is harmless here: the timer only says
// "look again" every min(delay, CheckPeriod), and job_state decides when
// the job is due, cluster-wide.

var (
	errTimeout = errors.New("job timeout exceeded")

	// Reasons gate.Lock gives gocron to skip an attempt without asking the
	// lock store. lockFailed ignores them: none is a skip worth counting
	// (overlap is counted where it is found).
	errNotDue   = errors.New("jobs: not due yet")
	errStopping = errors.New("jobs: scheduler stopping")
	errOverlap  = errors.New("jobs: previous attempt still in progress")
)

// retryAfterError spaces out attempts while the database or the lock store
// fails, so an outage logs one line per job per second, not per period.
const retryAfterError = time.Second

// gate is the gocron.Locker installed on every job. It wraps the adapter
// so that an attempt costs nothing while the job cannot be due, and so
// that Shutdown can wait for attempts from lock to release.
type gate struct{ s *Scheduler }

func (g gate) Lock(ctx context.Context, name string) (gocron.Lock, error) {
	s, e := g.s, g.s.byName[name]
	if !e.busy.CompareAndSwap(false, true) {
		// gocron's singleton mode should make this impossible; counting it
		// keeps the guarantee visible if that ever changes.
		s.m.count(e.name, OutcomeSkippedOverlap)
		return nil, errOverlap
	}
	if !s.enter() {
		e.busy.Store(false)
		return nil, errStopping
	}
	if time.Now().Before(e.nextCheck) {
		s.leave(e)
		return nil, errNotDue // by what this replica last read; no statement
	}
	l, err := s.gl.Lock(ctx, name)
	if err != nil {
		s.leave(e)
		return nil, err
	}
	return &gateLock{l: l, s: s, e: e}, nil
}

type gateLock struct {
	l gocron.Lock
	s *Scheduler
	e *entry
}

// Unlock releases the lease (the adapter logs and counts a failure) and
// only then ends the attempt, so Shutdown returns after every release.
func (g *gateLock) Unlock(ctx context.Context) error {
	defer g.s.leave(g.e)
	return g.l.Unlock(ctx)
}

// lockFailed is gocron's AfterLockError listener: gocron skipped the run
// because gate.Lock returned err.
func (s *Scheduler) lockFailed(_ uuid.UUID, name string, err error) {
	e := s.byName[name]
	switch {
	case errors.Is(err, errNotDue), errors.Is(err, errStopping), errors.Is(err, errOverlap):
	case lock.IsTimeout(err):
		// Another replica runs the job or is about to. Count it once per
		// stretch: while watching, this replica probes every period only
		// to notice a crashed holder, and those probes are not attempts.
		if !e.watching {
			e.watching = true
			s.m.count(e.name, OutcomeSkippedLocked)
			s.log.Debug("job skipped: lease held by another replica", "job", e.name)
		}
	default:
		// The adapter logged it (with error.code).
		e.nextCheck = time.Now().Add(retryAfterError)
	}
}

// attempt is the gocron task. gocron calls it only after gate.Lock took
// the lease, so the due check and the run happen under it.
func (s *Scheduler) attempt(e *entry) {
	lease, ok := s.gl.Lease(e.name)
	if !ok {
		s.log.Error("job called without its lease; run skipped", "job", e.name) // a wiring bug
		return
	}
	e.watching = false
	// Cancelled with cause lock.ErrLeaseLost when the lease is lost (the
	// provider renews it every ttl/3 and closes Lost when renewal fails),
	// or errShutdown at the end of the shutdown budget.
	ctx, cancel := lock.WithLease(s.base, lease)
	defer cancel()

	wait, prev, err := s.st.due(ctx, e.name, e.spec.Delay)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Log(context.Background(), lostLevel(err), "job state check failed; will retry", "job", e.name, "error", err)
			e.nextCheck = time.Now().Add(retryAfterError)
		}
		return
	}
	if prev != nil {
		s.log.Warn("previous run never finished; marked abandoned, next run after the delay",
			"job", e.name, "previous_instance", prev.Instance, "previous_run_id", prev.RunID,
			"previous_fencing_token", prev.Token)
	}
	if wait > 0 {
		if wait > e.period {
			// Another check comes before the job is due. Until then this
			// replica need not look: nobody may start the job earlier.
			s.m.count(e.name, OutcomeSkippedNotDue)
			s.log.Debug("job skipped: not due yet", "job", e.name, "due_in_ms", wait.Milliseconds())
			e.nextCheck = time.Now().Add(wait - e.period)
			return
		}
		// Due before the next tick: wait here, holding the lease, so the
		// run starts on time rather than up to a period late.
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
		case <-s.stopCh:
			return
		case <-ctx.Done():
			return
		}
	}
	select {
	case <-s.stopCh:
		// Shutdown began while this attempt was taking the lease or reading
		// job_state: no run starts from then on.
		return
	default:
	}
	select {
	case s.sem <- struct{}{}:
	default:
		// Refusing is deliberate (no queue): returning lets gocron release
		// the lease at once, so a replica with free capacity can run the job.
		s.m.count(e.name, OutcomeRejected)
		s.m.rejected.Inc()
		s.log.Error("job run rejected: executor at capacity", "job", e.name,
			"error.code", obs.CodeJobExecutorRejected, "limit", cap(s.sem))
		return
	}
	s.m.saturation.Set(float64(len(s.sem)) / float64(cap(s.sem)))
	defer func() {
		<-s.sem
		s.m.saturation.Set(float64(len(s.sem)) / float64(cap(s.sem)))
	}()
	s.run(ctx, e, lease)
}

// run executes one run of a due job and records it. leaseCtx is the
// attempt's context, cancelled when the lease is lost or at shutdown.
func (s *Scheduler) run(leaseCtx context.Context, e *entry, lease lock.Lease) {
	runID, token := uuid.NewString(), lease.Token()
	log := s.log.With("job", e.name, "run_id", runID, "fencing_token", token)
	ok, err := s.st.start(leaseCtx, e.name, e.spec.Delay, s.opts.InstanceID, token, runID)
	if err != nil {
		log.Log(context.Background(), lostLevel(err), "job start not recorded; run skipped", "error", err)
		e.nextCheck = time.Now().Add(retryAfterError)
		return
	}
	if !ok {
		s.m.count(e.name, OutcomeSkippedNotDue) // this timer fired before the database clock allowed it
		return
	}

	ctx, cancel := context.WithTimeoutCause(leaseCtx, e.spec.Timeout, errTimeout)
	defer cancel()
	ctx, span := startRun(ctx, e.name, runID, token)
	ctx, ri := withRun(ctx, lease, runID)
	ctx = obs.WithLogger(ctx, log)
	e.run.Store(true)
	s.m.running.WithLabelValues(e.name).Set(1)
	began := time.Now()
	stack, err := call(ctx, e.spec.Job)
	elapsed := time.Since(began)
	s.m.running.WithLabelValues(e.name).Set(0)
	e.run.Store(false)

	outcome, code := classify(ctx, err, stack != nil, ri.committed.Load())
	defer endRun(ctx, span, outcome, code, err)
	if outcome == OutcomeSuccess && errors.Is(context.Cause(ctx), lock.ErrLeaseLost) {
		log.WarnContext(ctx, "job lease lost after the run's fenced transaction committed; the run counts as a success")
	}
	var errText string
	if err != nil {
		errText = oneLine(err.Error(), 1000)
	}
	// The job's own transaction has committed (Run returned): now record
	// the end, before gocron releases the lease, and even if ctx was
	// cancelled.
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), stateTimeout)
	recorded, werr := s.st.finish(wctx, e.name, e.spec.Delay, token, outcome, errText)
	wcancel()
	e.nextCheck = time.Now().Add(e.spec.Delay - e.period)
	switch {
	case werr != nil:
		log.Log(context.Background(), lostLevel(werr), "job end not recorded; the next holder will mark the run abandoned", "error", werr)
		// The row still says running, so the delay counts only from when
		// a holder marks it abandoned. Look again at the next tick instead
		// of delay - period from now, or the rest nearly doubles.
		e.nextCheck = time.Now()
	case !recorded:
		log.Warn("job end not recorded: another replica took the job over")
	}

	s.m.count(e.name, outcome)
	obs.ObserveCtx(ctx, s.m.duration.WithLabelValues(e.name), elapsed.Seconds())
	if outcome == OutcomeSuccess {
		s.m.lastSuccess.WithLabelValues(e.name).Set(float64(time.Now().UnixNano()) / 1e9)
	}
	attrs := []any{"outcome", outcome, "duration_ms", elapsed.Milliseconds()}
	level := slog.LevelInfo
	switch {
	case outcome == OutcomeCancelled:
		level = slog.LevelWarn
	case outcome != OutcomeSuccess:
		level = lostLevel(err)
	}
	if err != nil {
		attrs = append(attrs, "error", errText)
	}
	if code != "" {
		attrs = append(attrs, slog.String("error.code", code))
	}
	if stack != nil {
		attrs = append(attrs, "stack", string(stack))
	}
	log.Log(ctx, level, "job run finished", attrs...) // ctx: the line carries the run's trace_id and span_id
}

// call runs the job, turning a panic into an error and its stack.
func call(ctx context.Context, j Job) (stack []byte, err error) {
	defer func() {
		if r := recover(); r != nil {
			stack = debug.Stack()
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return nil, j.Run(ctx)
}

// classify names the outcome of a run. committed: a transaction of the run
// committed under the lease's fence (InTx).
func classify(ctx context.Context, err error, panicked, committed bool) (outcome, code string) {
	cause := context.Cause(ctx)
	switch {
	case errors.Is(err, ErrCommitUnknown):
		// Neither lease_lost nor timeout, whose rows say the work rolled
		// back: it may have committed.
		return OutcomeFailure, obs.CodeOf(err)
	case errors.Is(cause, lock.ErrLeaseLost) && (err != nil || !committed),
		errors.Is(err, lock.ErrLeaseLost): // a failed fence, before Lost reached ctx
		// Even if the job returned nil: unless its writes committed under
		// the fence, part of it may have run unprotected.
		return OutcomeLeaseLost, obs.CodeOf(err)
	case err == nil:
		return OutcomeSuccess, ""
	case panicked:
		return OutcomeFailure, ""
	case errors.Is(cause, errTimeout):
		return OutcomeTimeout, obs.CodeJobTimeout
	case errors.Is(cause, errShutdown):
		return OutcomeCancelled, obs.CodeOf(err)
	default:
		return OutcomeFailure, obs.CodeOf(err)
	}
}

// lostLevel is ERROR, or WARN when err is the database connection lost:
// the worker says once that the database is unreachable, and the next run
// or holder recovers.
func lostLevel(err error) slog.Level {
	if obs.ConnectionLost(err) {
		return slog.LevelWarn
	}
	return slog.LevelError
}
