package lock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// notifyChannel carries the key of every released lease.
const notifyChannel = "worker_lock"

// minStatementBudget bounds one acquire statement that starts close to (or
// at) the caller's deadline: a healthy database answers in milliseconds, a
// hung one must not stretch TryAcquire by more than this.
const minStatementBudget = time.Second

// Every statement below is a single autocommit statement that carries all
// the state it needs (key, token, owner), and expiry is computed and judged
// only by clock_timestamp() on the server. Nothing lives in the session, so
// a transaction-mode pooler or a dropped connection cannot lose a lease.
const (
	// acquireSQL takes key if its grant is released or expired, in one
	// statement and one commit. It is the cheapest statement that can: a
	// single-row HOT update, no speculative insertion, no separate row-lock
	// record, one sequence draw. If the key is held or has no row yet, it
	// writes nothing and returns no row; acquireSlowSQL then looks.
	//
	// The token is drawn while projecting the row version being replaced,
	// so after that version was written: every earlier grant of the key
	// drew a smaller value. If another statement replaces or deletes that
	// version first, the update re-checks the expiry on the newest version
	// with the row locked, drawing again, or skips the row if it is held or
	// gone. So tokens of one key increase in grant order; the sequence never
	// goes back, so they keep increasing across restarts and after the
	// reaper deleted the row (a new row is written before any draw for it).
	acquireSQL = `
UPDATE worker_lock
   SET token       = nextval('worker_lock_token_seq'),
       owner       = $2,
       acquired_at = clock_timestamp(),
       expires_at  = clock_timestamp() + $3 * interval '1 microsecond',
       awaited     = false
 WHERE key = $1 AND expires_at <= clock_timestamp()
RETURNING token`

	// acquireSlowSQL runs when acquireSQL took nothing. It returns the
	// holder's remaining time in microseconds if the key is held, <= 0 if
	// it is free by now (released or expired since, or its row was just
	// created), and no row if the key's row is newer than its snapshot. In
	// the last two cases acquireSQL tries again.
	//
	// A key without a row (first use, or reaped) gets one that was never
	// granted: token 0, already expired. acquireSQL then grants it, so that
	// even a new row's token is drawn after the row exists. No token is
	// drawn here, and a row that exists costs ON CONFLICT DO NOTHING only
	// an index probe.
	//
	// When the key is held and the caller will wait ($2), it marks the
	// grant as awaited, so that its release notifies, unless a waiter did
	// already. If the snapshot shows a held, unmarked grant but marked
	// updated nothing, the row changed after the snapshot (typically a
	// release that committed meanwhile, which then notified nobody): the
	// snapshot's remaining time is stale, so it returns 0 and acquireSQL
	// looks again instead of sleeping on a key that may be free. A single
	// try ($2 false) on a held key writes nothing, so it costs no WAL
	// flush, and the releases of keys nobody waits for (the common case)
	// send no notification.
	acquireSlowSQL = `
WITH created AS (
    INSERT INTO worker_lock (key, token, owner, acquired_at, expires_at)
    VALUES ($1, 0, '', clock_timestamp(), clock_timestamp())
    ON CONFLICT (key) DO NOTHING
    RETURNING key
), marked AS (
    UPDATE worker_lock SET awaited = true
     WHERE key = $1 AND $2 AND NOT awaited AND expires_at > clock_timestamp()
    RETURNING expires_at
)
SELECT 0::bigint FROM created
UNION ALL
SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000000)::bigint FROM marked
UNION ALL
SELECT CASE WHEN expires_at > clock_timestamp() AND NOT ($2 AND NOT awaited)
            THEN (extract(epoch FROM expires_at - clock_timestamp()) * 1000000)::bigint
            ELSE 0 END
  FROM worker_lock WHERE key = $1
LIMIT 1`

	renewSQL = `
UPDATE worker_lock SET expires_at = clock_timestamp() + $4 * interval '1 microsecond'
 WHERE key = $1 AND token = $2 AND owner = $3 AND expires_at > clock_timestamp()`

	// releaseSQL expires the grant now (keeping the row and its token) and,
	// if a waiter marked it, notifies; the notification is delivered when
	// the statement commits. CASE evaluates pg_notify only when awaited.
	//
	// The release commits without waiting for its WAL flush
	// (synchronous_commit off for this statement's transaction only, so
	// nothing is left in the session). Safety never depends on a release
	// being durable: if the server crashes before the flush, the grant
	// merely stays until its ttl, as if the holder had crashed. A later
	// acquire of the key commits synchronously, and WAL is flushed in
	// order, so once anyone has taken the key over, the release is durable
	// too. Acquire and renew must stay synchronous: a lost acquire could
	// hand out its token again, and a lost renewal would end a grant
	// earlier than its holder believes.
	releaseSQL = `
UPDATE worker_lock SET expires_at = clock_timestamp()
 WHERE key = $1 AND token = $2 AND owner = $3 AND expires_at > clock_timestamp()
RETURNING CASE WHEN awaited THEN pg_notify('` + notifyChannel + `', key) END,
          set_config('synchronous_commit', 'off', true)`

	// fenceSQL runs inside the caller's transaction, as its last statement
	// before COMMIT. It returns a row only while the grant is held, and
	// locks that row FOR SHARE until the transaction ends: acquire, renew
	// and release all UPDATE the row, so a takeover waits for the caller's
	// COMMIT (or rollback) and then re-checks the expiry. There is no gap
	// between the check and the commit. A renewal waits too, for the one
	// COMMIT round trip.
	//
	// It also bounds how long the transaction may then sit idle. Only the
	// COMMIT is left to send, so a longer idle spell means the holder is
	// paused (SIGSTOP, a frozen VM) while it keeps the lease from being
	// taken over: after one ttl the server ends the session, rolling back.
	fenceSQL = `
SELECT set_config('idle_in_transaction_session_timeout', $4, true)
  FROM worker_lock
 WHERE key = $1 AND token = $2 AND owner = $3 AND expires_at > clock_timestamp()
   FOR SHARE`

	// reapSQL deletes one bounded batch of long-expired rows. SKIP LOCKED
	// keeps it out of the way of acquires; the repeated expiry test makes
	// a row taken over meanwhile survive.
	reapSQL = `
DELETE FROM worker_lock
 WHERE key IN (SELECT key FROM worker_lock
                WHERE expires_at < clock_timestamp() - $1 * interval '1 microsecond'
                LIMIT $2 FOR UPDATE SKIP LOCKED)
   AND expires_at < clock_timestamp() - $1 * interval '1 microsecond'`
)

// reapBatch bounds the rows one reaper statement deletes.
const reapBatch = 1000

// Postgres is the shared lease provider over the worker_lock table.
type Postgres struct {
	shared
	pool     *pgxpool.Pool
	connects atomic.Int64 // successful LISTENs, for tests and diagnostics
}

var _ Locker = (*Postgres)(nil)

// NewPostgres returns the PostgreSQL provider. instance names this replica
// in owner ids (a random part is appended); log may be nil. It starts the
// shared LISTEN connection in the background; Close stops it. Leases keep
// working without it, through the fallback poll.
func NewPostgres(pool *pgxpool.Pool, instance string, log *slog.Logger, opts ...Option) (*Postgres, error) {
	if pool == nil {
		return nil, errors.New("lock: nil pool")
	}
	p := &Postgres{pool: pool}
	go p.listen(p.init(instance, log, opts))
	return p, nil
}

// Provider names the provider in metrics.
func (p *Postgres) Provider() string { return "postgres" }

// TryAcquire implements Locker.
func (p *Postgres) TryAcquire(ctx context.Context, key string, wait, ttl time.Duration) (Lease, error) {
	return p.tryAcquire(ctx, key, wait, ttl, p, p.attempt)
}

// attempt tries to take key: acquireSQL, then if the key was not free,
// acquireSlowSQL to learn why, and acquireSQL again if it turned out free
// (or was just created). token > 0 means granted, sent being when the
// statement that granted it was sent (p.opts.now); otherwise remaining is
// the holder's time left, or -1 if unknown.
func (p *Postgres) attempt(ctx context.Context, key string, ttl time.Duration, deadline time.Time, willWait bool) (token int64, sent time.Time, remaining time.Duration, err error) {
	budget := deadline
	if floor := time.Now().Add(minStatementBudget); budget.Before(floor) {
		budget = floor
	}
	sctx, done := p.budgets.start(ctx, budget)
	defer done()
	for round := 1; ; round++ {
		sent = p.opts.now()
		err = p.pool.QueryRow(sctx, acquireSQL, key, p.owner, ttl.Microseconds()).Scan(&token)
		if !errors.Is(err, pgx.ErrNoRows) {
			break
		}
		var remainingUS int64
		err = p.pool.QueryRow(sctx, acquireSlowSQL, key, willWait).Scan(&remainingUS)
		switch {
		case err == nil && remainingUS > 0:
			return 0, sent, time.Duration(remainingUS) * time.Microsecond, nil
		case err == nil && round == 2:
			// Free again, so someone else took it in between, twice: the
			// caller tries again at once if it may still wait.
			return 0, sent, 0, nil
		case errors.Is(err, pgx.ErrNoRows) && round == 2:
			// A row newer than our snapshots: its remaining time is unknown
			// (and the grant is not marked), so fall back to the poll.
			return 0, sent, -1, nil
		case err == nil, errors.Is(err, pgx.ErrNoRows):
			continue // free by now, or a row just created: take it
		}
		break
	}
	switch {
	case err == nil:
		return token, sent, 0, nil
	case ctx.Err() != nil:
		return 0, sent, 0, ctx.Err()
	case errors.Is(context.Cause(sctx), errOverBudget):
		return 0, sent, 0, fmt.Errorf("lock: acquire %q: %w", key, errOverBudget)
	default:
		return 0, sent, 0, fmt.Errorf("lock: acquire %q: %w", key, err)
	}
}

// errOverBudget cancels acquire statements that outlive their budget.
var errOverBudget = fmt.Errorf("statement ran past its budget: %w", context.DeadlineExceeded)

// budgets bounds the acquire statements of a provider in flight (against
// a hung database) with one timer for all of them. A deadline context per
// attempt would arm a timer per acquire, and arming a new earliest timer
// makes the Go runtime wake an idle thread, which on a small machine takes
// CPU from the database while the statement runs: measured, a few percent
// of an uncontended acquire. This timer is re-armed only when it fires
// with statements still in flight, or when one needs it sooner.
type budgets struct {
	mu      sync.Mutex
	timer   *time.Timer // runs fire
	armedAt time.Time   // when timer fires; zero if it is not armed
	live    map[*budget]struct{}
}

type budget struct {
	at     time.Time
	cancel context.CancelCauseFunc
}

// start returns ctx, cancelled with cause errOverBudget once at passes,
// and the function that ends it, to call when its statements are done.
func (g *budgets) start(ctx context.Context, at time.Time) (context.Context, func()) {
	sctx, cancel := context.WithCancelCause(ctx)
	b := &budget{at: at, cancel: cancel}
	g.mu.Lock()
	g.live[b] = struct{}{}
	if g.armedAt.IsZero() || at.Before(g.armedAt) {
		g.armLocked(at)
	}
	g.mu.Unlock()
	return sctx, func() {
		g.mu.Lock()
		delete(g.live, b)
		g.mu.Unlock()
		cancel(nil)
	}
}

// fire cancels the statements past their budget and re-arms the timer for
// the earliest budget still running.
func (g *budgets) fire() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armedAt = time.Time{}
	now := time.Now()
	var next time.Time
	for b := range g.live {
		switch {
		case !now.Before(b.at):
			b.cancel(errOverBudget)
			delete(g.live, b)
		case next.IsZero() || b.at.Before(next):
			next = b.at
		}
	}
	if !next.IsZero() {
		g.armLocked(next)
	}
}

func (g *budgets) armLocked(at time.Time) {
	g.armedAt = at
	if g.timer == nil {
		g.timer = time.AfterFunc(time.Until(at), g.fire)
	} else {
		g.timer.Reset(time.Until(at))
	}
}

func (p *Postgres) renew(ctx context.Context, key string, token int64, owner string, ttl time.Duration) (bool, error) {
	tag, err := p.pool.Exec(ctx, renewSQL, key, token, owner, ttl.Microseconds())
	return tag.RowsAffected() == 1, err
}

func (p *Postgres) release(ctx context.Context, key string, token int64, owner string) (int64, bool, error) {
	tag, err := p.pool.Exec(ctx, releaseSQL, key, token, owner)
	if err != nil || tag.RowsAffected() == 1 {
		return 0, err == nil, err
	}
	// Expired: the key's current token says whether someone took it over.
	// Only for the warning, so a failed read costs nothing but the field.
	var highest int64
	_ = p.pool.QueryRow(ctx, `SELECT token FROM worker_lock WHERE key = $1`, key).Scan(&highest)
	return highest, false, nil
}

func (p *Postgres) fence(ctx context.Context, tx pgx.Tx, key string, token int64, owner string, ttl time.Duration) (int64, bool, error) {
	idle := strconv.FormatInt(max(ttl.Milliseconds(), 1), 10)
	var set string
	err := tx.QueryRow(ctx, fenceSQL, key, token, owner, idle).Scan(&set)
	if !errors.Is(err, pgx.ErrNoRows) {
		return 0, err == nil, err
	}
	// Refused. The key's current token tells the operator whether someone
	// took it over; tx rolls back anyway, so this read costs nothing later.
	var highest int64
	if err := tx.QueryRow(ctx, `SELECT token FROM worker_lock WHERE key = $1`, key).Scan(&highest); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, false, err
	}
	return highest, false, nil
}

// Reap deletes lease rows that expired more than olderThan ago, in bounded
// batches, and returns how many it deleted. Tokens stay monotonic because
// they come from a sequence, not from the row. Keys are a fixed set (job
// names), so live rows stay few; this only clears keys no longer in use.
func (p *Postgres) Reap(ctx context.Context, olderThan time.Duration) (int64, error) {
	var total int64
	for {
		tag, err := p.pool.Exec(ctx, reapSQL, max(olderThan, 0).Microseconds(), reapBatch)
		if err != nil {
			return total, fmt.Errorf("lock: reap: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < reapBatch {
			return total, nil
		}
	}
}

// CheckStore reports whether the PostgreSQL provider can work on pool: the
// worker_lock table and its token sequence exist, have the expected
// columns, and this role may use them. It writes nothing, so startup can
// run it when migrations are off (a failure there means exit 72).
func CheckStore(ctx context.Context, pool *pgxpool.Pool) error {
	var table, seq bool
	err := pool.QueryRow(ctx, `SELECT to_regclass('worker_lock') IS NOT NULL,
	                                  to_regclass('worker_lock_token_seq') IS NOT NULL`).Scan(&table, &seq)
	if err != nil {
		return fmt.Errorf("lock store: %w", err)
	}
	if !table || !seq {
		return errors.New("lock store: table worker_lock or sequence worker_lock_token_seq is missing (apply the migrations)")
	}
	if _, err := pool.Exec(ctx, `SELECT key, token, owner, acquired_at, expires_at, awaited FROM worker_lock LIMIT 0`); err != nil {
		return fmt.Errorf("lock store: worker_lock is not usable: %w", err)
	}
	var ok bool
	err = pool.QueryRow(ctx, `SELECT has_table_privilege('worker_lock', 'SELECT')
	                             AND has_table_privilege('worker_lock', 'INSERT')
	                             AND has_table_privilege('worker_lock', 'UPDATE')
	                             AND has_table_privilege('worker_lock', 'DELETE')
	                             AND has_sequence_privilege('worker_lock_token_seq', 'USAGE')`).Scan(&ok)
	if err != nil {
		return fmt.Errorf("lock store: %w", err)
	}
	if !ok {
		return errors.New("lock store: this role lacks SELECT/INSERT/UPDATE/DELETE on worker_lock or USAGE on worker_lock_token_seq")
	}
	return nil
}
