// Package outbox relays rows of the outbox_event table to a sink, in
// per-aggregate order, with several relays running at once.
package outbox

import "time"

// Config is the `outbox:` section of configs/worker.yaml (APP_OUTBOX_*).
type Config struct {
	Enabled         bool          `koanf:"enabled" yaml:"enabled"`
	Sink            string        `koanf:"sink" yaml:"sink"` // log | webhook
	Relays          int           `koanf:"relays" yaml:"relays"`
	BatchSize       int           `koanf:"batch_size" yaml:"batch_size"`
	PollInterval    time.Duration `koanf:"poll_interval" yaml:"poll_interval"`
	InFlightTimeout time.Duration `koanf:"in_flight_timeout" yaml:"in_flight_timeout"`
	MaxAttempts     int           `koanf:"max_attempts" yaml:"max_attempts"`
	BackoffBase     time.Duration `koanf:"backoff_base" yaml:"backoff_base"`
	BackoffMax      time.Duration `koanf:"backoff_max" yaml:"backoff_max"`
	BlockOnDead     bool          `koanf:"block_on_dead" yaml:"block_on_dead"`
	Retention       time.Duration `koanf:"retention" yaml:"retention"`
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
		BatchSize:       100,
		PollInterval:    time.Second,
		InFlightTimeout: 30 * time.Second,
		MaxAttempts:     3,
		BackoffBase:     time.Second,
		BackoffMax:      5 * time.Minute,
		Retention:       168 * time.Hour,
		Webhook:         WebhookConfig{Timeout: 10 * time.Second},
	}
}
