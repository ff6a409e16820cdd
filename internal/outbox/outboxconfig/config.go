// Package outbox relays rows of the outbox_event table to a sink, in
// per-aggregate order, with several relays running at once.
package outboxconfig

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Config is the `outbox:` section of configs/worker.yaml (APP_OUTBOX_*).
type Config struct {
	Enabled   bool   `koanf:"enabled" yaml:"enabled"`
	Sink      string `koanf:"sink" yaml:"sink"` // one of the Sink* names
	Relays    int    `koanf:"relays" yaml:"relays"`
	BatchSize int    `koanf:"batch_size" yaml:"batch_size"`
	// MaxInFlight bounds the publishes in progress at once in this
	// replica, across its relay loops; 0 means the sink's default
	// (DefaultMaxInFlight).
	MaxInFlight int `koanf:"max_in_flight" yaml:"max_in_flight"`
	// DetachAfter is how long a batch waits for its publishes before it
	// commits and lets the ones still outstanding finish on their own.
	DetachAfter     time.Duration `koanf:"detach_after" yaml:"detach_after"`
	PollInterval    time.Duration `koanf:"poll_interval" yaml:"poll_interval"`
	InFlightTimeout time.Duration `koanf:"in_flight_timeout" yaml:"in_flight_timeout"`
	MaxAttempts     int           `koanf:"max_attempts" yaml:"max_attempts"`
	BackoffBase     time.Duration `koanf:"backoff_base" yaml:"backoff_base"`
	BackoffMax      time.Duration `koanf:"backoff_max" yaml:"backoff_max"`
	// ProbeBackoffMax caps the wait between probes of a sink found
	// unavailable (breaker.go).
	ProbeBackoffMax time.Duration `koanf:"probe_backoff_max" yaml:"probe_backoff_max"`
	BlockOnDead     bool          `koanf:"block_on_dead" yaml:"block_on_dead"`
	// Retention is how long published events are kept: a partition is
	// dropped once it ends this long ago and all its events are done.
	Retention time.Duration `koanf:"retention" yaml:"retention"`
	// PartitionInterval is the time span of one outbox_event partition;
	// PartitionsAhead how many are kept ready past now.
	PartitionInterval time.Duration `koanf:"partition_interval" yaml:"partition_interval"`
	PartitionsAhead   int           `koanf:"partitions_ahead" yaml:"partitions_ahead"`
	// MetricsInterval is how often the relay refreshes outbox_pending_size
	// and outbox_publisher_lag_seconds from the table.
	MetricsInterval time.Duration  `koanf:"metrics_interval" yaml:"metrics_interval"`
	Webhook         WebhookConfig  `koanf:"webhook" yaml:"webhook"`
	NATS            NATSConfig     `koanf:"nats" yaml:"nats"`
	RabbitMQ        RabbitMQConfig `koanf:"rabbitmq" yaml:"rabbitmq"`
	Kafka           KafkaConfig    `koanf:"kafka" yaml:"kafka"`
	River           RiverConfig    `koanf:"river" yaml:"river"`
}

// RiverConfig configures the river sink, which turns each event into a
// River task in the relay's own transaction (internal/tasks).
type RiverConfig struct {
	// Routes maps an event type to the task kind its tasks get; "*" is the
	// default. YAML-only.
	Routes map[string]string `koanf:"routes" yaml:"routes"`
}

// RoutesKey is the configuration key of the river sink's routes, for
// error messages.
const RoutesKey = "outbox.river.routes"

// Sink names, the values of outbox.sink.
const (
	SinkLog      = "log"
	SinkWebhook  = "webhook"
	SinkNATS     = "nats"
	SinkRabbitMQ = "rabbitmq"
	SinkKafka    = "kafka"
	SinkRiver    = "river"
)

// WebhookConfig configures the webhook sink (outbox.webhook).
type WebhookConfig struct {
	URL     string        `koanf:"url" yaml:"url"`
	Secret  string        `koanf:"secret" yaml:"secret"`
	Timeout time.Duration `koanf:"timeout" yaml:"timeout"`
}

// Validate checks the webhook section; sink/webhook's New checks the URL.
func (c WebhookConfig) Validate() error {
	if c.URL == "" {
		return fmt.Errorf("outbox.webhook.url is empty: sink webhook needs an http(s) URL")
	}
	if c.Timeout < MinWebhookTimeout {
		return fmt.Errorf("outbox.webhook.timeout=%s: want at least %s", c.Timeout, MinWebhookTimeout)
	}
	return nil
}

// DefaultMaxInFlight is max_in_flight when the configuration leaves it 0.
// Each publish in flight to a webhook is a request, and a connection,
// that the receiver serves at once, so 64. A broker takes publishes in
// flight as a queue and writes and confirms them in rounds: with 256 in
// flight (the broker sinks' own max_pending) its rounds are larger, and
// RabbitMQ drained 16% faster, NATS 7% (docs/performance/sinks.md).
func DefaultMaxInFlight(sink string) int {
	switch sink {
	case SinkNATS, SinkRabbitMQ, SinkKafka:
		return 256
	}
	return 64
}

// The smallest values of the duration settings. Validate refuses less;
// DurationMinimums lists them by key for docs/configuration.md, which a
// test holds to them.
const (
	MinPollInterval        = 10 * time.Millisecond
	MinDetachAfter         = time.Millisecond
	MinInFlightTimeout     = time.Second // the claim transaction lives at most this long; a second leaves room for one publish and the final write
	MinBackoffBase         = time.Millisecond
	MinBackoffMax          = MinBackoffBase // and at least backoff_base
	MinProbeBackoffMax     = 10 * time.Millisecond
	MinRetention           = time.Minute
	MinPartitionInterval   = time.Second
	MinMetricsInterval     = 100 * time.Millisecond
	MinWebhookTimeout      = time.Millisecond
	MinConnectTimeout      = 100 * time.Millisecond // every broker sink's connect_timeout
	MinPublishTimeout      = time.Millisecond       // NATS and RabbitMQ
	MinKafkaPublishTimeout = time.Second            // franz-go's smallest record delivery timeout
)

// DurationMinimums are the constants above by key (outbox.<key>).
func DurationMinimums() map[string]time.Duration {
	return map[string]time.Duration{
		"outbox.poll_interval":            MinPollInterval,
		"outbox.detach_after":             MinDetachAfter,
		"outbox.in_flight_timeout":        MinInFlightTimeout,
		"outbox.backoff_base":             MinBackoffBase,
		"outbox.backoff_max":              MinBackoffMax,
		"outbox.probe_backoff_max":        MinProbeBackoffMax,
		"outbox.retention":                MinRetention,
		"outbox.partition_interval":       MinPartitionInterval,
		"outbox.metrics_interval":         MinMetricsInterval,
		"outbox.webhook.timeout":          MinWebhookTimeout,
		"outbox.nats.connect_timeout":     MinConnectTimeout,
		"outbox.nats.publish_timeout":     MinPublishTimeout,
		"outbox.rabbitmq.connect_timeout": MinConnectTimeout,
		"outbox.rabbitmq.publish_timeout": MinPublishTimeout,
		"outbox.kafka.connect_timeout":    MinConnectTimeout,
		"outbox.kafka.publish_timeout":    MinKafkaPublishTimeout,
	}
}

// DefaultConfig is the outbox configuration when nothing is set.
func DefaultConfig() Config {
	return Config{
		Enabled:           true,
		Sink:              SinkLog,
		Relays:            1,
		BatchSize:         500,
		MaxInFlight:       0, // the sink's
		DetachAfter:       100 * time.Millisecond,
		PollInterval:      time.Second,
		InFlightTimeout:   30 * time.Second,
		MaxAttempts:       3,
		BackoffBase:       time.Second,
		BackoffMax:        5 * time.Minute,
		ProbeBackoffMax:   5 * time.Second,
		Retention:         168 * time.Hour,
		PartitionInterval: 24 * time.Hour,
		PartitionsAhead:   7,
		MetricsInterval:   5 * time.Second,
		Webhook:           WebhookConfig{Timeout: 10 * time.Second},
		NATS:              DefaultNATSConfig(),
		RabbitMQ:          DefaultRabbitMQConfig(),
		Kafka:             DefaultKafkaConfig(),
	}
}

// Validate reports the first invalid relay setting, naming its key, the bad
// value and what is allowed. The sink's own section is checked by the sink
// table in startup, which knows every sink and its publish timeout.
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
	for _, err := range []error{
		between("relays", c.Relays, 1, 64),
		between("batch_size", c.BatchSize, 1, 10000),
		between("max_in_flight", c.MaxInFlight, 0, 10000),
		between("max_attempts", c.MaxAttempts, 1, 1000),
		atLeast("poll_interval", c.PollInterval, MinPollInterval),
		atLeast("detach_after", c.DetachAfter, MinDetachAfter),
		atLeast("in_flight_timeout", c.InFlightTimeout, MinInFlightTimeout),
		atLeast("backoff_base", c.BackoffBase, MinBackoffBase),
		atLeast("backoff_max", c.BackoffMax, MinBackoffMax),
		atLeast("probe_backoff_max", c.ProbeBackoffMax, MinProbeBackoffMax),
		atLeast("retention", c.Retention, MinRetention),
		atLeast("partition_interval", c.PartitionInterval, MinPartitionInterval),
		between("partitions_ahead", c.PartitionsAhead, 2, 1000),
		atLeast("metrics_interval", c.MetricsInterval, MinMetricsInterval),
	} {
		if err != nil {
			return err
		}
	}
	// Publishes start within detach_after of their claim and are cancelled
	// at 90% of in_flight_timeout after it. With detach_after at most half
	// of in_flight_timeout, 2.5 x a sink's publish timeout (checked by the
	// sink table in startup) leaves every publish its full timeout.
	if c.DetachAfter > c.InFlightTimeout/2 {
		return fmt.Errorf("outbox.detach_after=%s: want at most half of outbox.in_flight_timeout (%s)", c.DetachAfter, c.InFlightTimeout)
	}
	if c.BackoffMax < c.BackoffBase {
		return fmt.Errorf("outbox.backoff_max=%s: want at least outbox.backoff_base (%s)", c.BackoffMax, c.BackoffBase)
	}
	return nil
}

// NATSConfig configures the NATS JetStream sink (outbox.nats). It stays a
// plain struct, so the settings table and `config print` read it like the
// rest; the sink package turns it into a connection.
type NATSConfig struct {
	// URL is one server or a comma-separated list (nats:// or tls://).
	URL          string `koanf:"url" yaml:"url" secret:"urls"`
	Stream       string `koanf:"stream" yaml:"stream"`
	CreateStream bool   `koanf:"create_stream" yaml:"create_stream"`
	// Subject is a template: {prefix}, {aggregate_type}, {aggregate_id} and
	// {event_type}, each escaped to one subject token.
	Subject        string        `koanf:"subject" yaml:"subject"`
	SubjectPrefix  string        `koanf:"subject_prefix" yaml:"subject_prefix"`
	ConnectTimeout time.Duration `koanf:"connect_timeout" yaml:"connect_timeout"`
	PublishTimeout time.Duration `koanf:"publish_timeout" yaml:"publish_timeout"`
	// MaxPending bounds the publishes awaiting their ack on the connection.
	MaxPending   int    `koanf:"max_pending" yaml:"max_pending"`
	User         string `koanf:"user" yaml:"user"`
	Password     string `koanf:"password" yaml:"password" secret:"all"`
	Token        string `koanf:"token" yaml:"token" secret:"all"`
	NKeySeedFile string `koanf:"nkey_seed_file" yaml:"nkey_seed_file"`
	CredsFile    string `koanf:"creds_file" yaml:"creds_file"`
	TLSCAFile    string `koanf:"tls_ca_file" yaml:"tls_ca_file"`
	TLSCertFile  string `koanf:"tls_cert_file" yaml:"tls_cert_file"`
	TLSKeyFile   string `koanf:"tls_key_file" yaml:"tls_key_file"`
}

// DefaultNATSConfig is the outbox.nats section when nothing is set.
func DefaultNATSConfig() NATSConfig {
	return NATSConfig{
		URL:            "nats://127.0.0.1:4222",
		Stream:         "OUTBOX",
		Subject:        "{prefix}.{aggregate_type}.{event_type}",
		SubjectPrefix:  "outbox",
		ConnectTimeout: 30 * time.Second,
		PublishTimeout: 5 * time.Second,
		MaxPending:     256,
	}
}

// Validate checks the outbox.nats section; the sink package checks the
// subject template.
func (c NATSConfig) Validate() error {
	switch {
	case c.URL == "":
		return fmt.Errorf("outbox.nats.url is empty: want nats://host:4222 (or a comma-separated list)")
	case c.Stream == "" || strings.ContainsAny(c.Stream, ".*> \t\r\n"):
		return fmt.Errorf("outbox.nats.stream=%q: want a stream name without '.', '*', '>' or whitespace", c.Stream)
	case c.ConnectTimeout < MinConnectTimeout:
		return fmt.Errorf("outbox.nats.connect_timeout=%s: want at least %s", c.ConnectTimeout, MinConnectTimeout)
	case c.PublishTimeout < MinPublishTimeout:
		return fmt.Errorf("outbox.nats.publish_timeout=%s: want at least %s", c.PublishTimeout, MinPublishTimeout)
	case c.MaxPending < 1:
		return fmt.Errorf("outbox.nats.max_pending=%d: want at least 1", c.MaxPending)
	case c.Password != "" && c.User == "":
		return fmt.Errorf("outbox.nats.password is set without outbox.nats.user")
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return fmt.Errorf("outbox.nats.tls_cert_file and outbox.nats.tls_key_file: set both for a client certificate, or neither")
	}
	methods := 0
	for _, set := range []bool{c.User != "", c.Token != "", c.NKeySeedFile != "", c.CredsFile != ""} {
		if set {
			methods++
		}
	}
	if methods > 1 {
		return fmt.Errorf("outbox.nats: user, token, nkey_seed_file and creds_file are alternatives; set one")
	}
	return nil
}

// RabbitMQConfig configures the RabbitMQ sink (outbox.rabbitmq).
type RabbitMQConfig struct {
	// URL is amqp:// or amqps://, with credentials and vhost.
	URL             string `koanf:"url" yaml:"url" secret:"urls"`
	Exchange        string `koanf:"exchange" yaml:"exchange"`
	ExchangeType    string `koanf:"exchange_type" yaml:"exchange_type"`
	DeclareExchange bool   `koanf:"declare_exchange" yaml:"declare_exchange"`
	// RoutingKey is a template: {aggregate_type}, {aggregate_id} and
	// {event_type}, each escaped to one word.
	RoutingKey     string        `koanf:"routing_key" yaml:"routing_key"`
	AppID          string        `koanf:"app_id" yaml:"app_id"`
	ConnectTimeout time.Duration `koanf:"connect_timeout" yaml:"connect_timeout"`
	PublishTimeout time.Duration `koanf:"publish_timeout" yaml:"publish_timeout"`
	// MaxPending bounds the publishes awaiting their confirm.
	MaxPending  int    `koanf:"max_pending" yaml:"max_pending"`
	TLSCAFile   string `koanf:"tls_ca_file" yaml:"tls_ca_file"`
	TLSCertFile string `koanf:"tls_cert_file" yaml:"tls_cert_file"`
	TLSKeyFile  string `koanf:"tls_key_file" yaml:"tls_key_file"`
}

// DefaultRabbitMQConfig is the outbox.rabbitmq section when nothing is set.
func DefaultRabbitMQConfig() RabbitMQConfig {
	return RabbitMQConfig{
		URL:            "amqp://127.0.0.1:5672/",
		Exchange:       "outbox",
		ExchangeType:   "topic",
		RoutingKey:     "{aggregate_type}.{event_type}",
		AppID:          "worker",
		ConnectTimeout: 30 * time.Second,
		PublishTimeout: 5 * time.Second,
		MaxPending:     256,
	}
}

// Validate checks the outbox.rabbitmq section; the sink package checks the
// URL and the routing key template.
func (c RabbitMQConfig) Validate() error {
	switch {
	case c.URL == "":
		return fmt.Errorf("outbox.rabbitmq.url is empty: want amqp://user:password@host:5672/vhost")
	case c.DeclareExchange && c.Exchange == "":
		return fmt.Errorf("outbox.rabbitmq.declare_exchange=true needs outbox.rabbitmq.exchange: the default exchange cannot be declared")
	case c.DeclareExchange && !slices.Contains([]string{"topic", "direct", "fanout", "headers"}, c.ExchangeType):
		return fmt.Errorf("outbox.rabbitmq.exchange_type=%q: want topic, direct, fanout or headers", c.ExchangeType)
	case c.ConnectTimeout < MinConnectTimeout:
		return fmt.Errorf("outbox.rabbitmq.connect_timeout=%s: want at least %s", c.ConnectTimeout, MinConnectTimeout)
	case c.PublishTimeout < MinPublishTimeout:
		return fmt.Errorf("outbox.rabbitmq.publish_timeout=%s: want at least %s", c.PublishTimeout, MinPublishTimeout)
	case c.MaxPending < 1:
		return fmt.Errorf("outbox.rabbitmq.max_pending=%d: want at least 1", c.MaxPending)
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return fmt.Errorf("outbox.rabbitmq.tls_cert_file and outbox.rabbitmq.tls_key_file: set both for a client certificate, or neither")
	}
	return nil
}

// KafkaConfig configures the Kafka sink (outbox.kafka).
type KafkaConfig struct {
	// Brokers are the seed brokers, host:port, comma-separated.
	Brokers string `koanf:"brokers" yaml:"brokers"`
	// Topic is a template: {aggregate_type}, {aggregate_id} and
	// {event_type}, each escaped to legal topic characters.
	Topic          string        `koanf:"topic" yaml:"topic"`
	ClientID       string        `koanf:"client_id" yaml:"client_id"`
	ConnectTimeout time.Duration `koanf:"connect_timeout" yaml:"connect_timeout"`
	PublishTimeout time.Duration `koanf:"publish_timeout" yaml:"publish_timeout"`
	// SASLMechanism is "", PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
	SASLMechanism string `koanf:"sasl_mechanism" yaml:"sasl_mechanism"`
	SASLUser      string `koanf:"sasl_user" yaml:"sasl_user"`
	SASLPassword  string `koanf:"sasl_password" yaml:"sasl_password" secret:"all"`
	TLS           bool   `koanf:"tls" yaml:"tls"`
	TLSCAFile     string `koanf:"tls_ca_file" yaml:"tls_ca_file"`
	TLSCertFile   string `koanf:"tls_cert_file" yaml:"tls_cert_file"`
	TLSKeyFile    string `koanf:"tls_key_file" yaml:"tls_key_file"`
}

// DefaultKafkaConfig is the outbox.kafka section when nothing is set.
func DefaultKafkaConfig() KafkaConfig {
	return KafkaConfig{
		Brokers:        "127.0.0.1:9092",
		Topic:          "{aggregate_type}",
		ClientID:       "worker",
		ConnectTimeout: 30 * time.Second,
		PublishTimeout: 10 * time.Second,
	}
}

// Validate checks the outbox.kafka section; the sink package checks the
// topic template.
func (c KafkaConfig) Validate() error {
	switch {
	case strings.TrimSpace(c.Brokers) == "":
		return fmt.Errorf("outbox.kafka.brokers is empty: want host:port[,host:port...]")
	case c.ConnectTimeout < MinConnectTimeout:
		return fmt.Errorf("outbox.kafka.connect_timeout=%s: want at least %s", c.ConnectTimeout, MinConnectTimeout)
	case c.PublishTimeout < MinKafkaPublishTimeout:
		return fmt.Errorf("outbox.kafka.publish_timeout=%s: want at least %s (franz-go's smallest record delivery timeout)", c.PublishTimeout, MinKafkaPublishTimeout)
	case !slices.Contains([]string{"", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}, c.SASLMechanism):
		return fmt.Errorf("outbox.kafka.sasl_mechanism=%q: want PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or empty", c.SASLMechanism)
	case c.SASLMechanism != "" && c.SASLUser == "":
		return fmt.Errorf("outbox.kafka.sasl_user is empty: sasl_mechanism %s needs a user and password", c.SASLMechanism)
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return fmt.Errorf("outbox.kafka.tls_cert_file and outbox.kafka.tls_key_file: set both for a client certificate, or neither")
	}
	return nil
}
