package outbox

import (
	"errors"
	"time"

	"github.com/worker-dev/worker/internal/obs"
)

// backoff is the full-jitter backoff the outbox shares with tasks.
func backoff(base, max time.Duration, failures int) time.Duration {
	return obs.FullJitter(base, max, failures)
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
