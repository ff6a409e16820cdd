package obs

import (
	"context"
	"math/rand/v2"
	"time"
)

// FullJitter returns the wait before the next attempt after `failures`
// consecutive failures (1 for the first): "full jitter", a uniform draw from
// [0, min(max, base*2^(failures-1))]. Full jitter spreads the retries of
// many items that failed together (a sink outage) instead of sending them
// back in waves. cenkalti/backoff randomizes around the interval instead,
// which keeps the waves, hence these few lines. The outbox relay and tasks
// both retry with it.
func FullJitter(base, max time.Duration, failures int) time.Duration {
	ceil := base
	for i := 1; i < failures && ceil < max; i++ {
		ceil *= 2
	}
	if ceil > max {
		ceil = max
	}
	if ceil <= 0 {
		return 0
	}
	return rand.N(ceil + 1)
}

// Sleep waits for d or until ctx ends, and reports whether the wait ran
// its course: false means ctx ended first, and the caller should stop. A
// d of zero or less does not wait.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
