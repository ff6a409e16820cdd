package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/obs"
)

// round runs the work of claims once: every message's handler in one work
// transaction that ends by marking them PROCESSED, then it settles what
// that commit decided. Fresh claims are PROCESSING since their claim; a
// retry's are marked so first, in a commit of their own. It returns the
// claims to run again (failed, or held behind a failure of their order
// key) and the wait before that.
func (b *batchState) round(ctx context.Context, claims []*claim, fresh bool) (next []*claim, wait time.Duration, err error) {
	c := b.c
	began := time.Now()
	if fresh {
		began = b.started // the claim's lease runs since then
	}
	run, lost := claims, []*claim(nil)
	if !fresh {
		if run, lost, err = b.begin(ctx, claims); err != nil {
			return nil, 0, err
		}
	}
	if err := b.settleLost(ctx, lost); err != nil {
		return nil, 0, err
	}

	// The work may run for 2/3 of the lease: the last third leaves room
	// for the commit before another replica may find the lease expired.
	wctx, cancel := context.WithDeadline(ctx, began.Add(c.cfg.LeaseTTL*2/3))
	defer cancel()
	var res workResult
	for isolate := false; ; {
		res, err = b.work(wctx, run, isolate)
		var hf *handlerFailure
		switch {
		case errors.As(err, &hf) && !isolate:
			// Rare: run again with a savepoint per message, so that only
			// the failing ones roll back.
			isolate = true
			continue
		case errors.Is(err, errLost):
			if err := b.settleLost(ctx, res.lost); err != nil {
				return nil, 0, err
			}
			run = without(run, res.lost)
			continue
		case err != nil && wctx.Err() != nil && ctx.Err() == nil:
			// The work ran out of its share of the lease: it failed, each
			// of its messages spends an attempt.
			res, err = b.timedOut(ctx, run, time.Since(began))
		}
		break
	}
	if err != nil {
		return nil, 0, err
	}
	if len(res.done) > 0 && c.afterCommit != nil {
		c.afterCommit(len(res.done) + len(res.dead))
	}
	for _, cl := range res.done {
		b.settleClaim(ctx, cl, Processed, 0)
	}
	for _, f := range res.dead {
		b.deadLettered(f.cl, f.err.Error())
		b.settleClaim(ctx, f.cl, Dead, 0)
	}
	for _, f := range res.failed {
		c.m.received.WithLabelValues(c.name, string(Failed)).Inc()
		c.m.shared.Retry.WithLabelValues(JobName(c.name), obs.RetryScheduled).Inc()
		c.log.Warn("inbox message's work failed; it is retried after a backoff", "event_id", f.cl.d.Message.ID,
			"attempt", f.cl.attempts, "max_attempts", c.cfg.MaxAttempts, "retry_in", f.wait.String(), "error", f.err)
		wait = max(wait, f.wait)
		next = append(next, f.cl)
	}
	return append(next, res.held...), wait, nil
}

// begin marks claims PROCESSING again before a retry, and returns those
// still held and those lost to another claim.
func (b *batchState) begin(ctx context.Context, claims []*claim) (run, lost []*claim, err error) {
	c := b.c
	s, i := keyArrays(claimDeliveries(claims))
	attempts, err := collectKeyed[int](c.pool.Query(ctx, begin, c.name, s, i, c.owner, b.token, c.cfg.LeaseTTL))
	if err != nil {
		return nil, nil, err
	}
	for _, cl := range claims {
		if a, ok := attempts[cl.d.keyPair()]; ok {
			cl.attempts = a
			run = append(run, cl)
		} else {
			lost = append(lost, cl)
		}
	}
	return run, lost, nil
}

// failure is one message whose work failed in a round.
type failure struct {
	cl   *claim
	err  error
	wait time.Duration // before its retry
}

// workResult is what a work transaction committed.
type workResult struct {
	done   []*claim
	failed []failure // FAILED, to retry
	dead   []failure // out of attempts
	held   []*claim  // not run: an earlier message of their order key failed
	lost   []*claim  // taken from this claim before the commit (errLost)
}

// handlerFailure aborts a work transaction run without savepoints.
type handlerFailure struct{ err error }

func (h *handlerFailure) Error() string { return h.err.Error() }

// work runs run's handlers in one transaction and commits. Without
// isolate, the first failure rolls everything back (handlerFailure), and
// the caller runs again with isolate: a savepoint per message.
func (b *batchState) work(ctx context.Context, run []*claim, isolate bool) (res workResult, err error) {
	c := b.c
	if q, ok := c.handler.(batchQueuer); ok && !isolate {
		return b.workPipelined(ctx, run, q)
	}
	err = pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		res = workResult{}
		if _, err := tx.Exec(ctx, boundWork, b.bounds(ctx)...); err != nil {
			return err
		}
		var failed []failure
		blocked := map[string]bool{}
		for _, cl := range run {
			m := cl.d.Message
			if m.OrderKey != "" && blocked[m.OrderKey] {
				res.held = append(res.held, cl)
				continue
			}
			m.Attempt = cl.attempts + 1
			var herr error
			if isolate {
				herr = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { return c.handler.Handle(ctx, sp, m) })
			} else if herr = c.handler.Handle(ctx, tx, m); herr != nil {
				return &handlerFailure{herr}
			}
			if herr != nil {
				if tx.Conn().IsClosed() || ctx.Err() != nil {
					return herr // the database or the deadline, not this message
				}
				if m.OrderKey != "" {
					blocked[m.OrderKey] = true
				}
				failed = append(failed, failure{cl: cl, err: herr})
				continue
			}
			res.done = append(res.done, cl)
		}
		if len(res.done) > 0 {
			s, i := keyArrays(claimDeliveries(res.done))
			got, err := collectKeyed[struct{}](tx.Query(ctx, markProcessed, c.name, s, i, c.owner, b.token))
			if err != nil {
				return err
			}
			for _, cl := range res.done {
				if _, ok := got[cl.d.keyPair()]; !ok {
					res.lost = append(res.lost, cl)
				}
			}
			if len(res.lost) > 0 {
				return errLost
			}
		}
		if err := b.recordFailures(ctx, tx, failed, &res); err != nil {
			return err
		}
		if len(res.held) > 0 {
			s, i := keyArrays(claimDeliveries(res.held))
			if _, err := tx.Exec(ctx, release, c.name, s, i, c.owner, b.token, c.cfg.LeaseTTL); err != nil {
				return err
			}
		}
		return nil
	})
	return res, err
}

// workPipelined is work without isolation for a handler whose work is one
// statement: every message's statement and the final markProcessed go in
// one round trip. The first failure aborts the transaction
// (handlerFailure), and the caller runs again with isolation.
func (b *batchState) workPipelined(ctx context.Context, run []*claim, q batchQueuer) (res workResult, err error) {
	c := b.c
	err = pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		res = workResult{}
		batch := &pgx.Batch{}
		batch.Queue(boundWork, b.bounds(ctx)...)
		for _, cl := range run {
			m := cl.d.Message
			m.Attempt = cl.attempts + 1
			q.queue(batch, m)
		}
		s, i := keyArrays(claimDeliveries(run))
		batch.Queue(markProcessed, c.name, s, i, c.owner, b.token)
		br := tx.SendBatch(ctx, batch)
		defer br.Close()
		if _, err := br.Exec(); err != nil {
			return err
		}
		for range run {
			if _, err := br.Exec(); err != nil {
				if tx.Conn().IsClosed() || ctx.Err() != nil {
					return err // the database or the deadline, not a message
				}
				return &handlerFailure{err}
			}
		}
		got, err := collectKeyed[struct{}](br.Query())
		if err != nil {
			return err
		}
		for _, cl := range run {
			if _, ok := got[cl.d.keyPair()]; ok {
				res.done = append(res.done, cl)
			} else {
				res.lost = append(res.lost, cl)
			}
		}
		if len(res.lost) > 0 {
			return errLost
		}
		return br.Close()
	})
	return res, err
}

// boundWork bounds a work transaction on the server, where a holder that
// stops (SIGSTOP, a frozen VM) cannot stretch it: its statements end by
// the work's deadline, and a session left idle in the transaction, its
// rows locked by the final compare-and-set, is ended after a third of the
// lease. Its work rolls back, and the expired processing lease goes to an
// operator as designed instead of waiting on the stopped holder.
const boundWork = `SELECT set_config('statement_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $2, true)`

// bounds are boundWork's arguments for a work transaction under ctx.
func (b *batchState) bounds(ctx context.Context) []any {
	stmt := b.c.cfg.LeaseTTL * 2 / 3
	if d, ok := ctx.Deadline(); ok {
		stmt = max(time.Until(d), time.Millisecond)
	}
	idle := max(b.c.cfg.LeaseTTL/3, time.Millisecond)
	return []any{strconv.FormatInt(stmt.Milliseconds()+1, 10), strconv.FormatInt(idle.Milliseconds(), 10)}
}

// recordFailures writes failed work: FAILED with its backoff, or DEAD.
func (b *batchState) recordFailures(ctx context.Context, tx pgx.Tx, failed []failure, res *workResult) error {
	if len(failed) == 0 {
		return nil
	}
	c := b.c
	s, i := keyArrays(failedDeliveries(failed))
	errs, waits, permanent := make([]string, len(failed)), make([]float64, len(failed)), make([]bool, len(failed))
	for n := range failed {
		failed[n].wait = obs.FullJitter(c.cfg.BackoffBase, c.cfg.BackoffMax, failed[n].cl.attempts+1)
		errs[n], waits[n], permanent[n] = failed[n].err.Error(), failed[n].wait.Seconds(), isPermanent(failed[n].err)
	}
	state, err := collectKeyed[string](tx.Query(ctx, markFailed, c.name, s, i, c.owner, b.token, errs, waits, c.cfg.MaxAttempts, c.cfg.LeaseTTL, permanent))
	if err != nil {
		return err
	}
	for _, f := range failed {
		switch state[f.cl.d.keyPair()] {
		case "DEAD":
			res.dead = append(res.dead, f)
		case "FAILED":
			f.cl.attempts++
			res.failed = append(res.failed, f)
		default:
			res.lost = append(res.lost, f.cl)
		}
	}
	if len(res.lost) > 0 {
		return errLost
	}
	return nil
}

// timedOut records every message of run as failed: their work ran past
// its share of the lease and rolled back.
func (b *batchState) timedOut(ctx context.Context, run []*claim, took time.Duration) (res workResult, err error) {
	failed := make([]failure, len(run))
	for n, cl := range run {
		failed[n] = failure{cl: cl, err: fmt.Errorf("the batch's work ran for %s, past 2/3 of inbox.lease_ttl, and rolled back", took.Round(time.Millisecond))}
	}
	err = pgx.BeginFunc(ctx, b.c.pool, func(tx pgx.Tx) error {
		res = workResult{}
		return b.recordFailures(ctx, tx, failed, &res)
	})
	if errors.Is(err, errLost) {
		err = b.settleLost(ctx, res.lost)
	}
	return res, err
}

// settleLost settles claims this call no longer holds: the state their row
// is in says what to tell the source.
func (b *batchState) settleLost(ctx context.Context, lost []*claim) error {
	if len(lost) == 0 {
		return nil
	}
	c := b.c
	s, i := keyArrays(claimDeliveries(lost))
	state, err := collectKeyed[string](c.pool.Query(ctx, states, c.name, s, i))
	if err != nil {
		return err
	}
	for _, cl := range lost {
		switch state[cl.d.keyPair()] {
		case "PROCESSED", "RESOLVED", "DEAD", "RECOVERY_REQUIRED":
			b.settleClaim(ctx, cl, Duplicate, 0)
		default:
			b.settleClaim(ctx, cl, Busy, time.Second)
		}
	}
	return nil
}

func without(run, gone []*claim) []*claim {
	drop := map[*claim]bool{}
	for _, cl := range gone {
		drop[cl] = true
	}
	var out []*claim
	for _, cl := range run {
		if !drop[cl] {
			out = append(out, cl)
		}
	}
	return out
}

func failedDeliveries(fs []failure) []*Delivery {
	ds := make([]*Delivery, len(fs))
	for n, f := range fs {
		ds[n] = f.cl.d
	}
	return ds
}
