package lock

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/obs"
)

// store is what a provider contributes to a lease: the two statements that
// act on one grant. Both are matched on key, token and owner, so a stale
// holder can never touch a later grant. ok=false means the grant is no
// longer valid (its ttl ran out, whether or not someone took the key since).
type store interface {
	renew(ctx context.Context, key string, token int64, owner string, ttl time.Duration) (ok bool, err error)
	// release: ok=false means the grant was no longer valid; highest is
	// then the key's latest token the store knows (0 if none), for the
	// operator.
	release(ctx context.Context, key string, token int64, owner string) (highest int64, ok bool, err error)
	// fence checks, inside tx, that the grant is still valid, and keeps it
	// from being taken over until tx ends (or, for the Redis provider, keeps
	// any later grant's commits from passing before tx ends). ok=false: it
	// is not valid, and highest is the highest token the store has seen
	// for key (0 if it has none), for the operator.
	fence(ctx context.Context, tx pgx.Tx, key string, token int64, owner string, ttl time.Duration) (highest int64, ok bool, err error)
}

// lease is the provider-independent half of a grant: the holder's local
// expiry estimate, the heartbeat, loss detection and release reporting.
//
// The local estimate is deliberately pessimistic: it starts when the
// acquire or renew statement was sent, which is before the store computed
// its own expiry, so the holder always gives up no later than the store
// lets anyone else in (clock rates being equal).
//
// The heartbeat is a timer, not a goroutine: a lease costs nothing until
// its next renewal is due, and Release only has to stop the timer.
type lease struct {
	key, owner string
	token      int64
	ttl        time.Duration
	st         store
	now        func() time.Time
	log        *slog.Logger
	heartbeat  bool
	lost       chan struct{}
	ctx        context.Context // cancelled by Release to abort a renewal in flight
	cancel     context.CancelFunc

	mu        sync.Mutex // serializes renewals and Release; guards the fields below
	deadline  time.Time  // local estimate of the store's expiry
	renewedAt time.Time  // start of the last successful acquire or renew
	retryAt   time.Time  // next heartbeat attempt while renewals are failing
	retry     *backoff.ExponentialBackOff
	timer     *time.Timer // next heartbeat, or the expiry check
	released  bool
	isLost    bool
}

func newLease(key, owner string, token int64, ttl time.Duration, start time.Time, st store, o options, log *slog.Logger) *lease {
	ctx, cancel := context.WithCancel(context.Background())
	l := &lease{
		key: key, owner: owner, token: token, ttl: ttl, st: st, now: o.now,
		log:       log.With("key", key, "token", token, "owner", owner),
		heartbeat: o.heartbeat, lost: make(chan struct{}), ctx: ctx, cancel: cancel,
		deadline: start.Add(ttl), renewedAt: start,
	}
	l.mu.Lock()
	l.armLocked()
	l.mu.Unlock()
	return l
}

func (l *lease) Key() string           { return l.key }
func (l *lease) Token() int64          { return l.token }
func (l *lease) Lost() <-chan struct{} { return l.lost }

// Renew extends the grant by its ttl, measured from now by the store.
func (l *lease) Renew(ctx context.Context) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	err := l.renewLocked(ctx)
	if err == nil {
		l.armLocked()
	}
	return err
}

func (l *lease) renewLocked(ctx context.Context) error {
	switch {
	case l.released:
		return ErrLeaseReleased
	case l.isLost:
		return ErrLeaseLost
	}
	start := l.now()
	left := l.deadline.Sub(start)
	if left <= 0 {
		l.markLostLocked("ttl ran out before renewal")
		return ErrLeaseExpired
	}
	// A renewal that lands after our own estimate ran out is worthless: by
	// then we must already consider the lease gone.
	rctx, cancel := context.WithTimeout(ctx, left)
	ok, err := l.st.renew(rctx, l.key, l.token, l.owner, l.ttl)
	cancel()
	if err != nil {
		if !l.now().Before(l.deadline) {
			l.markLostLocked("renewal kept failing until the ttl ran out")
			return fmt.Errorf("%w (last renewal error: %v)", ErrLeaseExpired, err)
		}
		return fmt.Errorf("lock: renew %q: %w", l.key, err)
	}
	if !ok {
		l.markLostLocked("store reports the lease expired")
		return ErrLeaseExpired
	}
	l.deadline = start.Add(l.ttl)
	l.renewedAt = start
	return nil
}

// Release stops the heartbeat and gives the grant back. A lease that was
// lost, or whose ttl ran out, reports ErrLeaseExpired: the holder must learn
// that its protected work ran (partly) without the lease.
func (l *lease) Release(ctx context.Context) error {
	l.cancel() // don't wait out a heartbeat renewal in flight
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released {
		return nil
	}
	l.timer.Stop()
	expired := l.isLost || !l.now().Before(l.deadline)
	// Even a lease we consider expired goes through the store: if our
	// estimate was merely pessimistic, this frees the key for others now
	// instead of at the store's expiry.
	highest, ok, err := l.st.release(ctx, l.key, l.token, l.owner)
	if err != nil {
		// Not marked released: the caller may retry. If it never does, the
		// grant expires by itself. The heartbeat stays stopped, but Lost
		// must still fire when the holder's estimate runs out.
		l.timer.Reset(l.deadline.Sub(l.now()))
		return fmt.Errorf("lock: release %q: %w", l.key, err)
	}
	l.released = true
	if !ok || expired {
		// highest_token above ours: another holder did take the key over.
		l.log.Warn("lock lease released after it expired; the protected work may have overlapped another holder",
			"lost", l.isLost, "highest_token", max(highest, l.token))
		return ErrLeaseExpired
	}
	return nil
}

// Fence implements Lease. The store is the authority: a lease this holder
// already considers lost, because its pessimistic estimate ran out, may
// still pass if the store says it is held, which is safe because nobody
// can take it over before tx ends. A lease found no longer held is marked
// lost, so Lost fires and the protected work stops.
func (l *lease) Fence(ctx context.Context, tx pgx.Tx) error {
	l.mu.Lock()
	released := l.released
	l.mu.Unlock()
	if released {
		return ErrLeaseReleased
	}
	highest, ok, err := l.st.fence(ctx, tx, l.key, l.token, l.owner, l.ttl)
	if err != nil {
		return fmt.Errorf("lock: fence %q: %w", l.key, err)
	}
	if !ok {
		// Both tokens, so that an operator can tell a takeover (highest is
		// larger) from a grant that merely expired (highest is ours).
		l.log.Warn("lock fence refused the commit: the lease is no longer held", "highest_token", highest)
		l.mu.Lock()
		l.markLostLocked("fence found the lease no longer held")
		l.mu.Unlock()
		return fmt.Errorf("lock: fence %q refused token %d (highest token seen %d): %w", l.key, l.token, highest, ErrLeaseLost)
	}
	return nil
}

func (l *lease) markLostLocked(reason string) {
	if l.isLost {
		return
	}
	l.isLost = true
	close(l.lost)
	l.log.Warn("lock lease lost", "reason", reason)
}

// armLocked sets the timer for the lease's next duty: the heartbeat renewal
// (every ttl/3, sooner while retrying a failure) or, at the latest, the
// moment its local estimate runs out.
func (l *lease) armLocked() {
	wake := l.deadline
	if l.heartbeat {
		next := l.renewedAt.Add(l.ttl / 3)
		if l.retryAt.After(next) {
			next = l.retryAt
		}
		if next.Before(wake) {
			wake = next
		}
	}
	d := wake.Sub(l.now())
	if l.timer == nil {
		l.timer = time.AfterFunc(d, l.tick)
	} else {
		l.timer.Reset(d)
	}
}

// tick runs on the timer: renew if the heartbeat is due, declare the lease
// lost if its ttl ran out. Transient renewal errors are retried with
// backoff until then.
func (l *lease) tick() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released || l.isLost {
		return
	}
	if !l.now().Before(l.deadline) {
		l.markLostLocked("ttl ran out without a successful renewal")
		return
	}
	if l.ctx.Err() != nil {
		// A Release failed: no more renewals, only the expiry check.
		l.timer.Reset(l.deadline.Sub(l.now()))
		return
	}
	if l.heartbeat {
		switch err := l.renewLocked(l.ctx); {
		case err == nil:
			l.retryAt = time.Time{}
			l.retry = nil
		case l.isLost, l.ctx.Err() != nil:
			return
		default:
			if l.retry == nil {
				l.retry = &backoff.ExponentialBackOff{
					InitialInterval:     min(max(l.ttl/30, 10*time.Millisecond), 500*time.Millisecond),
					RandomizationFactor: 0.2,
					Multiplier:          2,
					MaxInterval:         max(l.ttl/6, 10*time.Millisecond),
				}
				l.retry.Reset()
			}
			l.log.Warn("lock lease renewal failed; retrying within the ttl", "error", err,
				"error.code", obs.CodeLockProviderUnavailable)
			l.retryAt = l.now().Add(l.retry.NextBackOff())
		}
	}
	l.armLocked()
}
