package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/tracing"
)

// round runs the work of claims once: every message's handler in one work
// transaction that ends by marking them PROCESSED, then it settles what
// that commit decided. What the transaction does first depends on kind:
// claim the messages (a transactional handler's first round: claim, work
// and PROCESSED commit together), nothing (an external handler's claims
// committed PROCESSING already), or take the held claims back to
// PROCESSING (a retry; an external handler's in a commit of its own
// first). It returns the claims to run again (failed, or held behind a
// failure of their order key) and the wait before that.
func (b *batchState) round(ctx context.Context, claims []*claim, kind roundKind) (next []*claim, wait time.Duration, err error) {
	c := b.c
	began := time.Now()
	if kind != retry {
		began = b.started // the claim's lease runs since then
	}
	run := claims
	if kind == retry && c.external {
		var lost []*claim
		if run, lost, err = b.begin(ctx, claims); err != nil {
			return nil, 0, err
		}
		if err := b.settleLost(ctx, lost); err != nil {
			return nil, 0, err
		}
		kind = claimed
	}

	// The work may run for 2/3 of the lease: the last third leaves room
	// for the commit before another replica may find the lease expired.
	wctx, cancel := context.WithDeadline(ctx, began.Add(c.cfg.LeaseTTL*2/3))
	defer cancel()
	var res workResult
	for isolate := false; ; {
		res, err = b.work(wctx, run, kind, isolate)
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
			res, err = b.timedOut(ctx, run, kind, time.Since(began))
		}
		break
	}
	if err != nil {
		return nil, 0, err
	}
	if len(res.done) > 0 && c.afterCommit != nil {
		c.afterCommit(len(res.done) + len(res.dead))
	}
	b.afterClaim(ctx, res.intake)
	if err := b.settleLost(ctx, res.gone); err != nil {
		return nil, 0, err
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

// begin marks an external handler's claims PROCESSING again, in a commit
// of its own, before a retry, and returns those still held and those lost
// to another claim.
func (b *batchState) begin(ctx context.Context, claims []*claim) (run, lost []*claim, err error) {
	c := b.c
	s, i := keyArrays(claimDeliveries(claims))
	attempts, err := collectKeyed[int](c.pool.Query(ctx, begin, c.name, s, i, c.owner, b.token, c.cfg.LeaseTTL))
	if err != nil {
		return nil, nil, err
	}
	run, lost = splitHeld(claims, attempts)
	return run, lost, nil
}

// splitHeld splits claims into those a statement returned (still held;
// their attempts updated) and the rest.
func splitHeld(claims []*claim, attempts map[[2]string]int) (held, lost []*claim) {
	for _, cl := range claims {
		if a, ok := attempts[cl.d.keyPair()]; ok {
			cl.attempts = a
			held = append(held, cl)
		} else {
			lost = append(lost, cl)
		}
	}
	return held, lost
}

// take starts a work transaction by doing what kind says (see round),
// bounded on the server, and returns the claims to work in it. With
// processed, a claim in the work writes new rows PROCESSED already: the
// caller's work either commits every message it takes or rolls back.
func (b *batchState) take(ctx context.Context, tx pgx.Tx, run []*claim, kind roundKind, processed bool, res *workResult) ([]*claim, error) {
	c := b.c
	switch kind {
	case claimInWork:
		in, err := b.claimIn(ctx, tx, run, processed)
		if err != nil {
			return nil, err
		}
		res.intake = in
		return in.run, nil
	case retry: // a transactional handler's: its rows stay FAILED if this rolls back
		batch := &pgx.Batch{}
		batch.Queue(boundWork, b.bounds(ctx)...)
		s, i := keyArrays(claimDeliveries(run))
		batch.Queue(begin, c.name, s, i, c.owner, b.token, c.cfg.LeaseTTL)
		br := tx.SendBatch(ctx, batch)
		defer br.Close()
		if _, err := br.Exec(); err != nil {
			return nil, err
		}
		attempts, err := collectKeyed[int](br.Query())
		if err != nil {
			return nil, err
		}
		var held []*claim
		held, res.gone = splitHeld(run, attempts)
		return held, br.Close()
	}
	_, err := tx.Exec(ctx, boundWork, b.bounds(ctx)...)
	return run, err
}

// failure is one message whose work failed in a round.
type failure struct {
	cl   *claim
	err  error
	wait time.Duration // before its retry
}

// workResult is what a work transaction committed.
type workResult struct {
	intake intake    // what its claim decided (claimInWork)
	gone   []*claim  // taken from this claim before the work began
	done   []*claim  // PROCESSED
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
func (b *batchState) work(ctx context.Context, run []*claim, kind roundKind, isolate bool) (res workResult, err error) {
	c := b.c
	var span trace.Span // the transaction's, through its commit
	err = pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		res = workResult{}
		// Without isolate, the first failure rolls everything back.
		todo, err := b.take(ctx, tx, run, kind, !isolate, &res)
		if err != nil || len(todo) == 0 {
			return err
		}
		var bctx context.Context
		bctx, span = c.startBatch(ctx, len(todo))
		if q, ok := c.handler.(batchQueuer); ok && !isolate {
			err = b.workPipelined(bctx, tx, todo, q, &res)
		} else {
			err = b.workEach(bctx, tx, todo, isolate, &res)
		}
		if err == nil && c.inWork != nil {
			c.inWork(len(todo))
		}
		return err
	})
	if span != nil {
		tracing.End(span, err)
	}
	return res, err
}

// workEach runs each message's handler in tx, then marks the messages.
func (b *batchState) workEach(ctx context.Context, tx pgx.Tx, run []*claim, isolate bool, res *workResult) error {
	c := b.c
	var failed []failure
	blocked := map[string]bool{}
	for _, cl := range run {
		m := cl.d.Message
		if m.OrderKey != "" && blocked[m.OrderKey] {
			res.held = append(res.held, cl)
			continue
		}
		m.Attempt = cl.attempts + 1
		hctx, span := c.startProcess(ctx, m)
		linkBatch(ctx, span)
		var herr error
		if isolate {
			herr = pgx.BeginFunc(hctx, tx, func(sp pgx.Tx) error { return c.handler.Handle(hctx, sp, m) })
		} else {
			herr = c.handler.Handle(hctx, tx, m)
		}
		tracing.End(span, herr)
		if herr != nil && !isolate {
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
	if mark := unwritten(res.done); len(mark) > 0 {
		s, i := keyArrays(claimDeliveries(mark))
		got, err := collectKeyed[struct{}](tx.Query(ctx, markProcessed, c.name, s, i, c.owner, b.token))
		if err != nil {
			return err
		}
		for _, cl := range mark {
			if _, ok := got[cl.d.keyPair()]; !ok {
				res.lost = append(res.lost, cl)
			}
		}
		if len(res.lost) > 0 {
			return errLost
		}
	}
	if err := b.recordFailures(ctx, tx, failed, res); err != nil {
		return err
	}
	if len(res.held) > 0 {
		s, i := keyArrays(claimDeliveries(res.held))
		if _, err := tx.Exec(ctx, release, c.name, s, i, c.owner, b.token, c.cfg.LeaseTTL); err != nil {
			return err
		}
	}
	return nil
}

// workPipelined is workEach without isolation for a handler whose work is
// one statement: every message's statement and the final markProcessed go
// in one round trip. The first failure aborts the transaction
// (handlerFailure), and the caller runs again with isolation.
func (b *batchState) workPipelined(ctx context.Context, tx pgx.Tx, run []*claim, q batchQueuer, res *workResult) error {
	c := b.c
	batch := &pgx.Batch{}
	spans := make([]trace.Span, len(run))
	for n, cl := range run {
		m := cl.d.Message
		m.Attempt = cl.attempts + 1
		_, spans[n] = c.startProcess(ctx, m)
		linkBatch(ctx, spans[n])
		q.Queue(batch, m)
	}
	// A statement's failure fails the whole round trip: every span ends
	// with the first error, and the isolated run that follows has its own.
	var berr error
	defer func() {
		for _, span := range spans {
			tracing.End(span, berr)
		}
	}()
	mark := unwritten(run)
	if len(mark) > 0 {
		s, i := keyArrays(claimDeliveries(mark))
		batch.Queue(markProcessed, c.name, s, i, c.owner, b.token)
	}
	br := tx.SendBatch(ctx, batch)
	defer br.Close()
	for range run {
		if _, err := br.Exec(); err != nil {
			berr = err
			if tx.Conn().IsClosed() || ctx.Err() != nil {
				return err // the database or the deadline, not a message
			}
			return &handlerFailure{err}
		}
	}
	got := map[[2]string]struct{}{}
	if len(mark) > 0 {
		var err error
		if got, err = collectKeyed[struct{}](br.Query()); err != nil {
			return err
		}
	}
	for _, cl := range run {
		if _, ok := got[cl.d.keyPair()]; ok || cl.written {
			res.done = append(res.done, cl)
		} else {
			res.lost = append(res.lost, cl)
		}
	}
	if len(res.lost) > 0 {
		return errLost
	}
	return br.Close()
}

// unwritten are the claims of cls whose rows markProcessed must still turn
// PROCESSED: all but those the claim wrote so (insertProcessed).
func unwritten(cls []*claim) []*claim {
	var out []*claim
	for _, cl := range cls {
		if !cl.written {
			out = append(out, cl)
		}
	}
	return out
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
// its share of the lease and rolled back. A claim made in that work
// transaction rolled back with it, so this one claims again first.
func (b *batchState) timedOut(ctx context.Context, run []*claim, kind roundKind, took time.Duration) (res workResult, err error) {
	reason := fmt.Errorf("the batch's work ran for %s, past 2/3 of inbox.lease_ttl, and rolled back", took.Round(time.Millisecond))
	err = pgx.BeginFunc(ctx, b.c.pool, func(tx pgx.Tx) error {
		res = workResult{}
		todo, err := b.take(ctx, tx, run, kind, false, &res)
		if err != nil {
			return err
		}
		failed := make([]failure, len(todo))
		for n, cl := range todo {
			failed[n] = failure{cl: cl, err: reason}
		}
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
		switch st := state[cl.d.keyPair()]; st {
		case StateProcessed, StateResolved, StateDead, StateRecoveryRequired:
			cl.found = st
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
