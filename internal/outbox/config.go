// Package outbox relays rows of the outbox_event table to a sink, in
// per-aggregate order, with several relays running at once.
package outbox

import (
	"fmt"
	"time"
)

// Config is the `outbox:` section of configs/worker.yaml (APP_OUTBOX_*).
type Config struct {
	Enabled   bool   `koanf:"enabled" yaml:"enabled"`
	Sink      string `koanf:"sink" yaml:"sink"` // log | webhook
	Relays    int    `koanf:"relays" yaml:"relays"`
	BatchSize int    `koanf:"batch_size" yaml:"batch_size"`
	// MaxInFlight bounds the publishes in progress at once in this
	// replica, across its relay loops.
	MaxInFlight int `koanf:"max_in_flight" yaml:"max_in_flight"`
	// DetachAfter is how long a batch waits for its publishes before it
	// commits and lets the ones still outstanding finish on their own.
	DetachAfter     time.Duration `koanf:"detach_after" yaml:"detach_after"`
	PollInterval    time.Duration `koanf:"poll_interval" yaml:"poll_interval"`
	InFlightTimeout time.Duration `koanf:"in_flight_timeout" yaml:"in_flight_timeout"`
	MaxAttempts     int           `koanf:"max_attempts" yaml:"max_attempts"`
	BackoffBase     time.Duration `koanf:"backoff_base" yaml:"backoff_base"`
	BackoffMax      time.Duration `koanf:"backoff_max" yaml:"backoff_max"`
	BlockOnDead     bool          `koanf:"block_on_dead" yaml:"block_on_dead"`
	Retention       time.Duration `koanf:"retention" yaml:"retention"`
	// MetricsInterval is how often the relay refreshes outbox_pending_size
	// and outbox_publisher_lag_seconds from the table.
	MetricsInterval time.Duration `koanf:"metrics_interval" yaml:"metrics_interval"`
	Webhook         WebhookConfig `koanf:"webhook" yaml:"webhook"`
}

// WebhookConfig configures the webhook sink.
type WebhookConfig struct {
	URL     string        `koanf:"url" yaml:"url"`
	Secret  string        `koanf:"secret" yaml:"secret"`
	Timeout time.Duration `koanf:"timeout" yaml:"timeout"`
}

// DefaultConfig is the outbox configuration when nothing is set.
func DefaultConfig() Config {
	return Config{
		Enabled:         true,
		Sink:            "log",
		Relays:          1,
		BatchSize:       500,
		MaxInFlight:     64,
		DetachAfter:     100 * time.Millisecond,
		PollInterval:    time.Second,
		InFlightTimeout: 30 * time.Second,
		MaxAttempts:     3,
		BackoffBase:     time.Second,
		BackoffMax:      5 * time.Minute,
		Retention:       168 * time.Hour,
		MetricsInterval: 5 * time.Second,
		Webhook:         WebhookConfig{Timeout: 10 * time.Second},
	}
}

// Validate reports the first invalid setting, naming its key, the bad value
// and what is allowed.
func (c Config) Validate() error {
	between := func(key string, v, lo, hi int) error {
		if v < lo || v > hi {
			return fmt.Errorf("outbox.%s=%d: want %d to %d", key, v, lo, hi)
		}
		return nil
	}
	atLeast := func(key string, v, lo time.Duration) error {
		if v < lo {
			return fmt.Errorf("outbox.%s=%s: want at least %s", key, v, lo)
		}
		return nil
	}
	switch c.Sink {
	case "log":
	case "webhook":
		if c.Webhook.URL == "" {
			return fmt.Errorf("outbox.webhook.url is empty: sink webhook needs an http(s) URL")
		}
		if err := atLeast("webhook.timeout", c.Webhook.Timeout, time.Millisecond); err != nil {
			return err
		}
	default:
		return fmt.Errorf("outbox.sink=%q: want log or webhook", c.Sink)
	}
	for _, err := range []error{
		between("relays", c.Relays, 1, 64),
		between("batch_size", c.BatchSize, 1, 10000),
		between("max_in_flight", c.MaxInFlight, 1, 10000),
		between("max_attempts", c.MaxAttempts, 1, 1000),
		atLeast("poll_interval", c.PollInterval, 10*time.Millisecond),
		atLeast("detach_after", c.DetachAfter, time.Millisecond),
		// The claim transaction lives at most this long; a second leaves
		// room for one publish and the final write.
		atLeast("in_flight_timeout", c.InFlightTimeout, time.Second),
		atLeast("backoff_base", c.BackoffBase, time.Millisecond),
		atLeast("retention", c.Retention, time.Minute),
		atLeast("metrics_interval", c.MetricsInterval, 100*time.Millisecond),
	} {
		if err != nil {
			return err
		}
	}
	// Publishes start within detach_after of their claim and are cancelled
	// at 90% of in_flight_timeout after it. With detach_after at most half
	// of in_flight_timeout, 2.5 x webhook.timeout leaves every webhook
	// publish its full timeout.
	if c.DetachAfter > c.InFlightTimeout/2 {
		return fmt.Errorf("outbox.detach_after=%s: want at most half of outbox.in_flight_timeout (%s)", c.DetachAfter, c.InFlightTimeout)
	}
	if c.Sink == "webhook" && c.InFlightTimeout < c.Webhook.Timeout*5/2 {
		return fmt.Errorf("outbox.in_flight_timeout=%s: want at least 2.5 x outbox.webhook.timeout (%s), so a publish always has its full timeout",
			c.InFlightTimeout, c.Webhook.Timeout)
	}
	if c.BackoffMax < c.BackoffBase {
		return fmt.Errorf("outbox.backoff_max=%s: want at least outbox.backoff_base (%s)", c.BackoffMax, c.BackoffBase)
	}
	return nil
}
