package outbox

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

func TestConfigValidate(t *testing.T) {
	if err := outboxconfig.DefaultConfig().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for _, c := range []struct {
		key    string
		change func(*outboxconfig.Config)
	}{
		{"outbox.relays", func(c *outboxconfig.Config) { c.Relays = 0 }},
		{"outbox.batch_size", func(c *outboxconfig.Config) { c.BatchSize = 0 }},
		{"outbox.batch_size", func(c *outboxconfig.Config) { c.BatchSize = 10001 }},
		{"outbox.max_attempts", func(c *outboxconfig.Config) { c.MaxAttempts = 0 }},
		{"outbox.max_in_flight", func(c *outboxconfig.Config) { c.MaxInFlight = -1 }},
		{"outbox.max_in_flight", func(c *outboxconfig.Config) { c.MaxInFlight = 10001 }},
		{"outbox.detach_after", func(c *outboxconfig.Config) { c.DetachAfter = 0 }},
		{"outbox.detach_after", func(c *outboxconfig.Config) { c.DetachAfter = c.InFlightTimeout }},
		{"outbox.poll_interval", func(c *outboxconfig.Config) { c.PollInterval = 0 }},
		{"outbox.in_flight_timeout", func(c *outboxconfig.Config) { c.InFlightTimeout = 500 * time.Millisecond }},
		{"outbox.backoff_base", func(c *outboxconfig.Config) { c.BackoffBase = 0 }},
		{"outbox.backoff_max", func(c *outboxconfig.Config) { c.BackoffMax = c.BackoffBase / 2 }},
		{"outbox.retention", func(c *outboxconfig.Config) { c.Retention = time.Second }},
		{"outbox.metrics_interval", func(c *outboxconfig.Config) { c.MetricsInterval = 0 }},
	} {
		cfg := outboxconfig.DefaultConfig()
		c.change(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), c.key) {
			t.Errorf("%s: got %v, want an error naming the key", c.key, err)
		}
	}
}

func TestBackoffFullJitter(t *testing.T) {
	base, ceiling := 100*time.Millisecond, time.Second
	for failures, bound := range map[int]time.Duration{1: base, 2: 2 * base, 3: 4 * base, 4: 8 * base, 5: ceiling, 60: ceiling} {
		var top time.Duration
		for range 2000 {
			d := backoff(base, ceiling, failures)
			if d < 0 || d > bound {
				t.Fatalf("failures %d: %s outside [0, %s]", failures, d, bound)
			}
			top = max(top, d)
		}
		// Full jitter spreads over the whole range.
		if top < bound*8/10 {
			t.Errorf("failures %d: largest of 2000 draws %s, expected near %s", failures, top, bound)
		}
	}
	ra := &RetryAfterError{Err: errors.New("slow down"), After: 5 * time.Second}
	if d := retryDelay(base, ceiling, 1, ra); d != 5*time.Second {
		t.Errorf("Retry-After 5s gave %s", d)
	}
	if d := retryDelay(base, ceiling, 1, errors.New("x")); d > base {
		t.Errorf("plain error gave %s", d)
	}
}
