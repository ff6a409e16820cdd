package jobs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/google/uuid"

	"worker/internal/lock"
	"worker/internal/obs"
)

// Why the lease is taken here, through the lock port, and not by gocron's
// WithDistributedJobLocker (checked against gocron v2.21.2):
//   - gocron's Lock result never reaches the job function, so the job could
//     not read its fencing token, and a lost lease could not cancel the
//     job's context;
//   - the due check against job_state must run while holding the lease and
//     may decide not to run; gocron's locker can only say "locked";
//   - after a lock failure with WithIntervalFromCompletion, gocron re-arms
//     from this replica's own last completion, not from the cluster's last
//     run: the timer offset problem of gocron #841;
//   - gocron unlocks with the job's context, already cancelled at shutdown,
//     and discards the error, while the run's end must be recorded and the
//     lease released after the job's transaction committed, with a context
//     that survives the cancellation.

var errTimeout = errors.New("job timeout exceeded")

// retryAfterError spaces out attempts while the database or the lock store
// fails, so an outage logs one line per job per second, not per period.
const retryAfterError = time.Second

// tick is what gocron calls every period on every replica.
func (s *Scheduler) tick(e *entry) {
	if !e.busy.CompareAndSwap(false, true) {
		// gocron's singleton mode should make this impossible; counting it
		// keeps the guarantee visible if that ever changes.
		s.m.count(e.name, OutcomeSkippedOverlap)
		return
	}
	defer e.busy.Store(false)
	if !s.enter() {
		return
	}
	defer s.inflight.Done()
	if time.Now().Before(e.nextCheck) {
		return // not due by what this replica last read; no database call
	}
	s.attempt(e)
}

// attempt takes the lease, checks job_state and runs the job if it is due.
func (s *Scheduler) attempt(e *entry) {
	// While watching another replica's run, waiting is pointless: the probe
	// only looks for a holder that died.
	acquireWait := s.opts.AcquireWait
	if e.watching {
		acquireWait = 0
	}
	lease, err := s.opts.Locker.TryAcquire(s.base, e.key, acquireWait, e.spec.LeaseTTL)
	if err != nil {
		s.notAcquired(e, err)
		return
	}
	e.watching = false
	h := s.hold(lease)
	// Released last: after the run's end was recorded (see run), and with a
	// context of its own, so it happens even when shutdown cancelled the run.
	defer func() {
		switch err := h.release(); {
		case err == nil:
		case errors.Is(err, lock.ErrLeaseExpired):
			// The provider already logs and counts this (lock_lease_expired_total).
			s.log.Debug("job lease had expired when released", "job", e.name, "fencing_token", lease.Token())
		default:
			s.log.Warn("job lease release failed; it expires after its ttl", "job", e.name,
				"fencing_token", lease.Token(), "error", err)
		}
	}()

	wait, prev, err := s.st.due(h.ctx, e.name, e.spec.Delay)
	if err != nil {
		if h.ctx.Err() == nil {
			s.log.Error("job state check failed; will retry", "job", e.name, "error", err)
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
		case <-h.ctx.Done():
			return
		}
	}
	select {
	case s.sem <- struct{}{}:
	default:
		// Refusing is deliberate (no queue): the lease is released at once,
		// so a replica with free capacity can run the job.
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
	s.run(e, h)
}

func (s *Scheduler) notAcquired(e *entry, err error) {
	switch {
	case lock.IsTimeout(err):
		// Another replica runs the job or is about to. Count it once per
		// stretch: while watching, this replica probes every period only
		// to notice a crashed holder, and those probes are not attempts.
		if !e.watching {
			e.watching = true
			s.m.count(e.name, OutcomeSkippedLocked)
			s.log.Debug("job skipped: lease held by another replica", "job", e.name)
		}
	case s.base.Err() != nil:
	default:
		s.log.Warn("job lease not acquired; will retry", "job", e.name, "error", err, "error.code", obs.CodeOf(err))
		e.nextCheck = time.Now().Add(retryAfterError)
	}
}

// run executes one run of a due job and records it.
func (s *Scheduler) run(e *entry, h *hold) {
	runID := uuid.NewString()
	token := h.lease.Token()
	log := s.log.With("job", e.name, "run_id", runID, "fencing_token", token)
	ok, err := s.st.start(h.ctx, e.name, e.spec.Delay, s.opts.InstanceID, token, runID)
	if err != nil {
		log.Error("job start not recorded; run skipped", "error", err)
		e.nextCheck = time.Now().Add(retryAfterError)
		return
	}
	if !ok {
		s.m.count(e.name, OutcomeSkippedNotDue) // this timer fired before the database clock allowed it
		return
	}

	ctx, cancel := context.WithTimeoutCause(h.ctx, e.spec.Timeout, errTimeout)
	defer cancel()
	ctx = obs.WithLogger(withRun(ctx, token, runID), log)
	e.run.Store(true)
	s.m.running.WithLabelValues(e.name).Set(1)
	began := time.Now()
	stack, err := call(ctx, e.spec.Job)
	elapsed := time.Since(began)
	s.m.running.WithLabelValues(e.name).Set(0)
	e.run.Store(false)

	outcome, code := classify(ctx, err, stack != nil)
	var errText string
	if err != nil {
		errText = oneLine(err.Error(), 1000)
	}
	// The job's own transaction has committed (Run returned): now record
	// the end, before the lease is released, and even if ctx was cancelled.
	wctx, wcancel := context.WithTimeout(context.WithoutCancel(ctx), stateTimeout)
	recorded, werr := s.st.finish(wctx, e.name, e.spec.Delay, token, outcome, errText)
	wcancel()
	switch {
	case werr != nil:
		log.Error("job end not recorded; the next holder will mark the run abandoned", "error", werr)
	case !recorded:
		log.Warn("job end not recorded: another replica took the job over")
	}
	e.nextCheck = time.Now().Add(e.spec.Delay - e.period)

	s.m.count(e.name, outcome)
	s.m.duration.WithLabelValues(e.name).Observe(elapsed.Seconds())
	if outcome == OutcomeSuccess {
		s.m.lastSuccess.WithLabelValues(e.name).Set(float64(time.Now().UnixNano()) / 1e9)
	}
	attrs := []any{"outcome", outcome, "duration_ms", elapsed.Milliseconds()}
	level := slog.LevelInfo
	switch {
	case outcome == OutcomeCancelled:
		level = slog.LevelWarn
	case outcome != OutcomeSuccess:
		level = slog.LevelError
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
	log.Log(context.Background(), level, "job run finished", attrs...)
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

func classify(ctx context.Context, err error, panicked bool) (outcome, code string) {
	cause := context.Cause(ctx)
	switch {
	case errors.Is(cause, lock.ErrLeaseLost):
		// Even if the job returned nil: part of it ran unprotected.
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

// hold is a held lease. ctx is cancelled with cause lock.ErrLeaseLost when
// the lease is lost (the provider renews it every ttl/3 and closes Lost
// when renewal fails), or errShutdown at the end of the shutdown budget.
type hold struct {
	lease  lock.Lease
	ctx    context.Context
	cancel context.CancelFunc
}

func (s *Scheduler) hold(lease lock.Lease) *hold {
	ctx, cancel := lock.WithLease(s.base, lease)
	return &hold{lease: lease, ctx: ctx, cancel: cancel}
}

// release gives the lease back, with a context that survives shutdown.
// The error is lock.ErrLeaseExpired if the lease ran out while held.
func (h *hold) release() error {
	ctx, cancel := context.WithTimeout(context.Background(), stateTimeout)
	defer cancel()
	err := h.lease.Release(ctx)
	h.cancel()
	return err
}
