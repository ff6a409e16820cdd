package lock

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// InProcess is the single-instance provider: the same contract as the
// PostgreSQL provider (ttl, fencing tokens, expiry reporting, Lost, bounded
// wait, prompt wake on release), kept in memory. It coordinates goroutines
// of one process only, so it must never back APP_MULTI_INSTANCE_ENABLED.
type InProcess struct {
	tab   *memTable
	owner string
	opts  options
	log   *slog.Logger
}

// memTable plays the role of the worker_lock table, with the process clock
// as the "database" clock.
type memTable struct {
	mu   sync.Mutex
	rows map[string]*memRow
	last int64 // last token granted
}

type memRow struct {
	token   int64
	owner   string
	expires time.Time
	freed   chan struct{} // closed when the grant is released
}

var _ Locker = (*InProcess)(nil)

// NewInProcess returns an in-memory provider. instance names the process in
// owner ids and logs; log may be nil.
func NewInProcess(instance string, log *slog.Logger, opts ...Option) *InProcess {
	return (&InProcess{tab: &memTable{rows: map[string]*memRow{}}}).sibling(instance, log, opts...)
}

// sibling returns another provider over the same table, the in-memory
// analogue of a second replica, so the contract tests can exercise owner
// checks and takeovers identically for both providers.
func (p *InProcess) sibling(instance string, log *slog.Logger, opts ...Option) *InProcess {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &InProcess{tab: p.tab, owner: newOwner(instance), opts: buildOptions(opts), log: log}
}

// Owner is the id this provider writes into its grants.
func (p *InProcess) Owner() string { return p.owner }

// Provider names the provider in metrics.
func (p *InProcess) Provider() string { return "inprocess" }

// TryAcquire implements Locker.
func (p *InProcess) TryAcquire(ctx context.Context, key string, wait, ttl time.Duration) (Lease, error) {
	if err := checkArgs(key, ttl); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(max(wait, 0))
	for {
		start := p.opts.now()
		token, freed, remaining := p.tab.grant(key, p.owner, ttl)
		if token > 0 {
			return newLease(key, p.owner, token, ttl, start, p.tab, p.opts, p.log), nil
		}
		left := time.Until(deadline)
		if left <= 0 {
			return nil, &TimeoutError{Key: key, Wait: wait}
		}
		if p.opts.waitHook != nil {
			p.opts.waitHook(key)
		}
		// Wake on release, at the holder's expiry, or at our deadline.
		t := time.NewTimer(min(remaining, left))
		select {
		case <-freed:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		t.Stop()
	}
}

// grant takes key if it is free or expired. Otherwise it returns the
// holder's release channel and remaining time.
func (t *memTable) grant(key, owner string, ttl time.Duration) (token int64, freed <-chan struct{}, remaining time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if r := t.rows[key]; r != nil && now.Before(r.expires) {
		return 0, r.freed, r.expires.Sub(now)
	}
	// Seeding from the wall clock keeps tokens increasing across restarts
	// of the process, as long as the clock does not jump back.
	t.last = max(t.last+1, now.UnixNano())
	t.rows[key] = &memRow{token: t.last, owner: owner, expires: now.Add(ttl), freed: make(chan struct{})}
	return t.last, nil, 0
}

// valid returns key's row if it is still the live grant (token, owner).
func (t *memTable) valid(key string, token int64, owner string) (*memRow, time.Time) {
	now := time.Now()
	r := t.rows[key]
	if r == nil || r.token != token || r.owner != owner || !now.Before(r.expires) {
		return nil, now
	}
	return r, now
}

func (t *memTable) renew(_ context.Context, key string, token int64, owner string, ttl time.Duration) (bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, now := t.valid(key, token, owner)
	if r == nil {
		return false, nil
	}
	r.expires = now.Add(ttl)
	return true, nil
}

func (t *memTable) release(_ context.Context, key string, token int64, owner string) (int64, bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, _ := t.valid(key, token, owner)
	if r == nil {
		if r := t.rows[key]; r != nil {
			return r.token, false, nil
		}
		return 0, false, nil
	}
	close(r.freed)
	delete(t.rows, key)
	return 0, true, nil
}

// fence checks the grant in memory: tx is not the store here. The check
// cannot hold the grant until tx commits, so it leaves the gap of one
// COMMIT round trip; single-instance mode has no other process that could
// take the key over in it (see docs/lock.md).
func (t *memTable) fence(_ context.Context, _ pgx.Tx, key string, token int64, owner string, _ time.Duration) (int64, bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r, _ := t.valid(key, token, owner); r != nil {
		return 0, true, nil
	}
	highest := token
	if r := t.rows[key]; r != nil {
		highest = max(highest, r.token)
	}
	return highest, false, nil
}

// forceExpire ends key's grant now, as if its ttl had run out (tests).
func (t *memTable) forceExpire(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r := t.rows[key]; r != nil {
		r.expires = time.Now()
	}
}
