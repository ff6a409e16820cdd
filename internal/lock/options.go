package lock

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"time"
)

// DefaultPollInterval is how often a waiter re-checks a held key when no
// release notification arrives. Notifications make handover fast; the poll
// only covers lost notifications (listener reconnecting, or a pooler that
// does not forward LISTEN), so it can be slow and cheap.
const DefaultPollInterval = 200 * time.Millisecond

// minPollInterval keeps a misconfigured poll from hammering the database.
const minPollInterval = 50 * time.Millisecond

// Option tunes a provider.
type Option func(*options)

type options struct {
	heartbeat    bool
	pollInterval time.Duration
	now          func() time.Time
	// waitHook, if set, runs each time a waiter goes to sleep after finding
	// its key held. Tests and benchmarks use it to know a waiter is parked.
	waitHook func(key string)
}

func buildOptions(opts []Option) options {
	o := options{heartbeat: true, pollInterval: DefaultPollInterval, now: time.Now}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithoutHeartbeat turns off automatic renewal: leases then live for one ttl
// unless the holder calls Renew. Lost still fires when that ttl runs out.
// By default every lease renews itself every ttl/3 until it is released.
func WithoutHeartbeat() Option { return func(o *options) { o.heartbeat = false } }

// WithPollInterval sets the fallback poll of a waiting TryAcquire
// (PostgreSQL provider; default DefaultPollInterval, at least 50ms).
func WithPollInterval(d time.Duration) Option {
	return func(o *options) { o.pollInterval = max(d, minPollInterval) }
}

// WithClock replaces the clock used for the holder's local estimate of its
// lease's expiry. Only differences between its readings are used, so it
// must keep Go's monotonic reading (time.Now().Add(offset) does). Expiry
// itself is always judged by the store's clock; this option exists so tests
// can prove that a skewed replica clock changes nothing.
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

func withWaitHook(f func(key string)) Option { return func(o *options) { o.waitHook = f } }

func checkArgs(key string, ttl time.Duration) error {
	if key == "" {
		return errors.New("lock: empty key")
	}
	if ttl <= 0 {
		return errors.New("lock: ttl must be positive")
	}
	return nil
}

// newOwner makes a provider's owner id: the instance id plus a random part,
// so two providers in one process, or a restarted process reusing its
// instance id, can never pass for each other's grants.
func newOwner(instance string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	if instance == "" {
		return hex.EncodeToString(b)
	}
	return instance + "-" + hex.EncodeToString(b)
}
