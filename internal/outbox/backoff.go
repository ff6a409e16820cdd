package outbox

import (
	"errors"
	"math/rand/v2"
	"time"
)

// backoff returns the wait before the next attempt after `failures`
// consecutive failures (1 for the first): "full jitter", a uniform draw from
// [0, min(max, base*2^(failures-1))]. Full jitter spreads the retries of
// many events that failed together (a sink outage) instead of sending them
// back in waves. cenkalti/backoff randomizes around the interval instead,
// which keeps the waves, hence these few lines.
func backoff(base, max time.Duration, failures int) time.Duration {
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

// retryDelay is the wait before retrying an event whose publish failed with
// err: the jittered backoff, but never less than a Retry-After the sink
// reported.
func retryDelay(base, max time.Duration, failures int, err error) time.Duration {
	d := backoff(base, max, failures)
	var ra *RetryAfterError
	if errors.As(err, &ra) && ra.After > d {
		d = ra.After
	}
	return d
}
