package jobs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	// commitTimeout bounds the COMMIT of a fenced transaction. It runs on a
	// context the run's cancellation does not reach: once the fence holds
	// the lease, committing is safe, and the run must learn whether it did.
	commitTimeout = 5 * time.Second

	// statementTimeoutGrace is added to the run's remaining time for the
	// transaction's statement_timeout. The server's timer is the backstop
	// for a worker that can no longer cancel (killed, stopped at once);
	// while the worker lives, the run's own deadline must fire first, so
	// that the run ends as a timeout (JOB_TIMEOUT) rather than as a failure
	// with the server's "canceling statement due to statement timeout".
	statementTimeoutGrace = time.Second
)

var (
	// errNoRun: InTx was called with a context that is not a job run's.
	errNoRun = errors.New("jobs: InTx needs the context of a job run, whose lease fences the transaction")
	// errTxEnded: the work ended InTx's transaction itself.
	errTxEnded = errors.New("jobs: the job's work ended its transaction itself (COMMIT or ROLLBACK), " +
		"so its writes were not fenced by the lease and may have committed; remove the transaction control")

	// ErrCommitUnknown: the COMMIT was sent but no answer came back (the
	// connection broke or the commit timeout passed). The server may have
	// committed or not; only the data can tell.
	ErrCommitUnknown = errors.New("jobs: commit outcome unknown: the connection failed before the server answered the COMMIT, " +
		"so the transaction's writes may or may not be in")
)

// InTx runs fn in a transaction on pool, fenced by the current run's lease,
// and commits it. It is the way for a job to write to the database:
//
//   - Before fn, the transaction-local settings worker.fencing_token and
//     worker.run_id are set, and statement_timeout is set to the time left
//     of the run's timeout plus statementTimeoutGrace, so the server stops
//     the work even if this process dies.
//   - After fn, the last statement before COMMIT proves that the lease is
//     still held and keeps it so until the COMMIT (lock.Lease.Fence). If it
//     is not, the transaction rolls back and InTx returns an error wrapping
//     lock.ErrLeaseLost. So a run that lost its lease (a pause, a network
//     cut) never commits after another replica took the job over.
//   - If the run's context is cancelled (timeout, lease lost, shutdown)
//     during a statement, pgx abandons the connection and sends the server a
//     cancel request, so the statement stops there too, and nothing
//     commits.
//   - A COMMIT that got no answer (the connection broke) returns an error
//     wrapping ErrCommitUnknown: the writes may be in or not.
//   - A COMMIT that succeeded counts: the run's outcome is success even if
//     the lease is lost afterwards (a warning is logged).
//
// ctx must be the run's context (or derived from it). fn must use ctx for
// its statements and must not commit or roll back tx itself (InTx then
// fails with errTxEnded: its writes escaped the fence). pool must
// reach the database that holds the leases (the worker's database).
func InTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) error {
	ri, ok := runOf(ctx)
	if !ok {
		return errNoRun
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	if err := fencedWork(ctx, tx, ri, fn); err != nil {
		rollback(ctx, tx)
		if cause := context.Cause(ctx); cause != nil {
			return fmt.Errorf("transaction rolled back: %w (%w)", cause, err)
		}
		return err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if err := tx.Commit(cctx); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) {
			return fmt.Errorf("%w: %w", ErrCommitUnknown, err)
		}
		return fmt.Errorf("commit: %w", err) // the server answered: rolled back
	}
	ri.committed.Store(true)
	return nil
}

// fencedWork runs everything of InTx's transaction before the COMMIT.
func fencedWork(ctx context.Context, tx pgx.Tx, ri *runInfo, fn func(pgx.Tx) error) error {
	var timeoutMS int64
	if d, ok := ctx.Deadline(); ok {
		timeoutMS = max(time.Until(d)+statementTimeoutGrace, time.Millisecond).Milliseconds()
	}
	if _, err := tx.Exec(ctx, `SELECT set_config('worker.fencing_token', $1, true),
       set_config('worker.run_id', $2, true),
       CASE WHEN $3::bigint > 0 THEN set_config('statement_timeout', $3::text, true) END`,
		strconv.FormatInt(ri.lease.Token(), 10), ri.runID, timeoutMS); err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		return err
	}
	// A COMMIT in the work (a sql job's text may hold one) committed what
	// ran before it unfenced, and what ran after it in autocommit: fencing
	// now would prove nothing about those writes, and a failed fence would
	// report lease_lost for writes that are in. ('I' is idle, outside any
	// transaction; the status comes with each reply, so this costs nothing.)
	if tx.Conn().PgConn().TxStatus() == 'I' {
		return errTxEnded
	}
	return ri.lease.Fence(ctx, tx)
}

// rollback ends tx on a context the run's cancellation does not reach, so
// the connection goes back to the pool clean. (pgx closes it if the
// rollback fails.)
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}
