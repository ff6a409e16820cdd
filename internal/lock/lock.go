// Package lock is the distributed lease lock port used by jobs and the
// outbox. Providers (in-process, PostgreSQL, Redis) live beside it; callers
// depend only on the types in this file.
package lock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/obs"
)

// Locker grants leases. There is deliberately no blocking Acquire: every
// acquisition is bounded by wait.
type Locker interface {
	// TryAcquire returns a lease on key valid for ttl, or a *TimeoutError no
	// later than wait after the call. ctx cancellation returns ctx.Err().
	TryAcquire(ctx context.Context, key string, wait, ttl time.Duration) (Lease, error)
}

// Lease is one grant of a key.
type Lease interface {
	Key() string
	// Token is the fencing token: strictly greater than any earlier grant of
	// the same key, across takeovers and restarts.
	Token() int64
	// Renew extends the lease by its ttl. It returns ErrLeaseExpired or
	// ErrLeaseLost (and fires Lost) when the lease is no longer ours.
	Renew(ctx context.Context) error
	// Release gives the lease back. Releasing a valid lease twice is a no-op;
	// releasing an expired one returns ErrLeaseExpired.
	Release(ctx context.Context) error
	// Lost is closed when the lease is known to be no longer held: a renewal
	// found it expired or taken, or renewal kept failing until the ttl ran out.
	Lost() <-chan struct{}
	// Fence proves, as a statement of tx, that the lease is still held,
	// and keeps it held until tx ends: run it as the last statement before
	// COMMIT. It returns an error wrapping ErrLeaseLost when the lease is
	// no longer held; then the caller must roll back. See docs/lock.md.
	Fence(ctx context.Context, tx pgx.Tx) error
}

var (
	// ErrLeaseExpired: the lease's ttl ran out before Release or Renew.
	ErrLeaseExpired = errors.New("lock: lease expired")
	// ErrLeaseLost: the lease was declared lost (renewal failed).
	ErrLeaseLost = errors.New("lock: lease lost")
	// ErrLeaseReleased: Renew on a lease that was already released.
	ErrLeaseReleased = errors.New("lock: lease released")
)

// TimeoutError is returned when a key stays held for the whole wait.
type TimeoutError struct {
	Key  string
	Wait time.Duration
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("lock: %q still held after waiting %s", e.Key, e.Wait)
}

// Code implements obs.Coded.
func (e *TimeoutError) Code() string { return obs.CodeLockAcquisitionTimeout }

// StoreError is a provider's store failing an acquisition for a reason
// other than a held key: unreachable, hung past its budget, or refusing
// the statement. Logged with error.code=LOCK_PROVIDER_UNAVAILABLE; Health
// reports the outage as a whole.
type StoreError struct {
	Err error
}

func (e *StoreError) Error() string { return e.Err.Error() }
func (e *StoreError) Unwrap() error { return e.Err }

// Code implements obs.Coded.
func (e *StoreError) Code() string { return obs.CodeLockProviderUnavailable }

// IsTimeout reports whether err is an acquisition timeout.
func IsTimeout(err error) bool {
	var t *TimeoutError
	return errors.As(err, &t)
}

// WithLease returns a context that is cancelled, with cause ErrLeaseLost,
// when the lease is lost. Protected work runs under it so that a replica
// that lost its lease stops instead of racing the new holder. The returned
// cancel must be called when the work ends.
func WithLease(ctx context.Context, l Lease) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	go func() {
		select {
		case <-l.Lost():
			cancel(ErrLeaseLost)
		case <-ctx.Done():
		}
	}()
	return ctx, func() { cancel(context.Canceled) }
}
