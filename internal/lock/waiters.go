package lock

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// waitRoom is where a shared provider's waiting TryAcquire calls park: the
// local state of every key that goroutines wait for, woken by the store's
// release notifications (PostgreSQL NOTIFY, Redis PUBLISH).
type waitRoom struct {
	mu   sync.Mutex
	keys map[string]*keyWaiters
}

// keyWaiters is the local state of one key that goroutines are waiting
// for: who to wake on a notification, and a gate that lets only one of
// them poll the store at a time.
type keyWaiters struct {
	gate    chan struct{}
	waiters map[chan struct{}]struct{}
}

func newWaitRoom() waitRoom { return waitRoom{keys: map[string]*keyWaiters{}} }

// shared is what the shared providers (PostgreSQL, Redis) have in common:
// the owner id they grant under, the options, this process's waiters, the
// budgets of the statements in flight, and the lifetime of the background
// listener whose notifications wake the waiters.
type shared struct {
	owner   string
	opts    options
	log     *slog.Logger
	room    waitRoom
	budgets budgets

	stop      context.CancelFunc
	closeOnce sync.Once
	done      chan struct{}
}

// init sets s up and returns the context its listener runs in until Close;
// the listener closes s.done when it returns.
func (s *shared) init(instance string, log *slog.Logger, opts []Option) context.Context {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.owner, s.opts, s.log = newOwner(instance), buildOptions(opts), log
	s.room, s.stop, s.done = newWaitRoom(), cancel, make(chan struct{})
	s.budgets.live = map[*budget]struct{}{}
	return ctx
}

// Owner is the id this provider writes into its grants.
func (s *shared) Owner() string { return s.owner }

// Close stops the listener. Held leases are not touched: release them
// first.
func (s *shared) Close() {
	s.closeOnce.Do(func() {
		s.stop()
		<-s.done
	})
}

// tryAcquire is TryAcquire for a provider that makes one attempt with
// attempt, and whose leases renew and release through st.
func (s *shared) tryAcquire(ctx context.Context, key string, wait, ttl time.Duration, st store,
	attempt func(ctx context.Context, key string, ttl time.Duration, deadline time.Time, willWait bool) (int64, time.Time, time.Duration, error)) (Lease, error) {
	if err := checkArgs(key, ttl); err != nil {
		return nil, err
	}
	token, sent, err := s.room.acquire(ctx, key, wait, s.opts, func(deadline time.Time, willWait bool) (int64, time.Time, time.Duration, error) {
		return attempt(ctx, key, ttl, deadline, willWait)
	})
	if err != nil {
		if !IsTimeout(err) && ctx.Err() == nil {
			err = &StoreError{Err: err}
		}
		return nil, err
	}
	return newLease(key, s.owner, token, ttl, sent, st, s.opts, s.log), nil
}

// attemptFunc makes one attempt to take a key. token > 0 means granted,
// sent being when the statement that granted it was sent (options.now);
// otherwise remaining is the holder's time left by the store's clock, or -1
// if unknown.
type attemptFunc func(deadline time.Time, willWait bool) (token int64, sent time.Time, remaining time.Duration, err error)

// acquire runs attempts on key until one grants it or wait runs out.
func (r *waitRoom) acquire(ctx context.Context, key string, wait time.Duration, o options, attempt attemptFunc) (int64, time.Time, error) {
	deadline := time.Now().Add(max(wait, 0))
	// Subscribe before the first attempt, so a release that commits right
	// after it still wakes us.
	kw, wake := r.subscribe(key)
	defer r.unsubscribe(key, wake)

	// Local waiters for one key take turns at the gate: N goroutines of a
	// replica cost the store one poller, not N.
	select {
	case kw.gate <- struct{}{}:
	default:
		t := time.NewTimer(time.Until(deadline))
		select {
		case kw.gate <- struct{}{}:
			t.Stop()
		case <-t.C:
			return 0, time.Time{}, &TimeoutError{Key: key, Wait: wait}
		case <-ctx.Done():
			t.Stop()
			return 0, time.Time{}, ctx.Err()
		}
	}
	defer func() { <-kw.gate }()
	select {
	case <-wake: // a release from before our first attempt: it will see it
	default:
	}

	for {
		token, sent, remaining, err := attempt(deadline, time.Until(deadline) > 0)
		if err != nil {
			return 0, time.Time{}, err
		}
		if token > 0 {
			return token, sent, nil
		}
		left := time.Until(deadline)
		if left <= 0 {
			return 0, time.Time{}, &TimeoutError{Key: key, Wait: wait}
		}
		// Sleep until a release notification, the holder's expiry by the
		// store's clock, the next fallback poll, or (last attempt) exactly
		// our deadline, whichever comes first.
		sleep := min(o.pollInterval, left)
		if remaining >= 0 {
			sleep = min(sleep, remaining)
		}
		if o.waitHook != nil {
			o.waitHook(key)
		}
		t := time.NewTimer(sleep)
		select {
		case <-wake:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return 0, time.Time{}, ctx.Err()
		}
		t.Stop()
	}
}

func (r *waitRoom) subscribe(key string) (*keyWaiters, chan struct{}) {
	wake := make(chan struct{}, 1)
	r.mu.Lock()
	defer r.mu.Unlock()
	kw := r.keys[key]
	if kw == nil {
		kw = &keyWaiters{gate: make(chan struct{}, 1), waiters: map[chan struct{}]struct{}{}}
		r.keys[key] = kw
	}
	kw.waiters[wake] = struct{}{}
	return kw, wake
}

func (r *waitRoom) unsubscribe(key string, wake chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	kw := r.keys[key]
	delete(kw.waiters, wake)
	if len(kw.waiters) == 0 {
		delete(r.keys, key)
	}
}

// wake signals the local waiters of key.
func (r *waitRoom) wake(key string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if kw := r.keys[key]; kw != nil {
		kw.signal()
	}
}

// wakeAll signals every local waiter: after the listener (re)connects, a
// release may have gone by unheard.
func (r *waitRoom) wakeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, kw := range r.keys {
		kw.signal()
	}
}

func (kw *keyWaiters) signal() {
	for w := range kw.waiters {
		select {
		case w <- struct{}{}:
		default: // already signalled
		}
	}
}
