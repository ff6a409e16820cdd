package inboxconfig

import "time"

// The sections of each source kind. They stay plain structs, like the
// outbox sinks' sections, so `config print` masks them alike (secret tags);
// the source packages turn them into connections.

// NATSSource is a JetStream durable pull consumer with explicit ack
// (inbox.sources[].nats).
type NATSSource struct {
	URL    string `koanf:"url" yaml:"url" secret:"urls"`
	Stream string `koanf:"stream" yaml:"stream"`
	// Consumer is the durable consumer's name; replicas that share it
	// share the messages.
	Consumer string `koanf:"consumer" yaml:"consumer"`
	// FilterSubject limits the consumer to matching subjects ("" is all
	// of the stream's).
	FilterSubject string `koanf:"filter_subject" yaml:"filter_subject"`
	// CreateConsumer creates or updates the consumer at start; otherwise
	// it must exist.
	CreateConsumer bool `koanf:"create_consumer" yaml:"create_consumer"`
	// AckWait is the consumer's ack wait when this source creates it: how
	// long the server waits for an ack before redelivering. The source
	// extends it ("in progress") every third of it while a batch's work
	// runs, so it bounds how long a dead replica's messages wait, not how
	// long work may take.
	AckWait time.Duration `koanf:"ack_wait" yaml:"ack_wait"`
	// MaxAckPending bounds the unacknowledged messages, across replicas,
	// when this source creates the consumer. 1 keeps the stream's order
	// across replicas (docs/inbox.md, "Order").
	MaxAckPending  int           `koanf:"max_ack_pending" yaml:"max_ack_pending"`
	ConnectTimeout time.Duration `koanf:"connect_timeout" yaml:"connect_timeout"`
	User           string        `koanf:"user" yaml:"user"`
	Password       string        `koanf:"password" yaml:"password" secret:"all"`
	Token          string        `koanf:"token" yaml:"token" secret:"all"`
	NKeySeedFile   string        `koanf:"nkey_seed_file" yaml:"nkey_seed_file"`
	CredsFile      string        `koanf:"creds_file" yaml:"creds_file"`
	TLSCAFile      string        `koanf:"tls_ca_file" yaml:"tls_ca_file"`
	TLSCertFile    string        `koanf:"tls_cert_file" yaml:"tls_cert_file"`
	TLSKeyFile     string        `koanf:"tls_key_file" yaml:"tls_key_file"`
}

// RabbitMQSource is a queue consumed with manual ack and a prefetch limit
// (inbox.sources[].rabbitmq).
type RabbitMQSource struct {
	URL   string `koanf:"url" yaml:"url" secret:"urls"`
	Queue string `koanf:"queue" yaml:"queue"`
	// Prefetch bounds the unacknowledged deliveries on this replica's
	// channel.
	Prefetch int `koanf:"prefetch" yaml:"prefetch"`
	// DeclareQueue declares a durable quorum queue of this name with
	// single active consumer, which keeps its order across replicas.
	DeclareQueue   bool          `koanf:"declare_queue" yaml:"declare_queue"`
	ConnectTimeout time.Duration `koanf:"connect_timeout" yaml:"connect_timeout"`
	TLSCAFile      string        `koanf:"tls_ca_file" yaml:"tls_ca_file"`
	TLSCertFile    string        `koanf:"tls_cert_file" yaml:"tls_cert_file"`
	TLSKeyFile     string        `koanf:"tls_key_file" yaml:"tls_key_file"`
}

// KafkaSource is a consumer group that commits offsets only after the
// inbox commit (inbox.sources[].kafka).
type KafkaSource struct {
	Brokers string `koanf:"brokers" yaml:"brokers"`
	// Topics are comma-separated.
	Topics         string        `koanf:"topics" yaml:"topics"`
	Group          string        `koanf:"group" yaml:"group"`
	ClientID       string        `koanf:"client_id" yaml:"client_id"`
	ConnectTimeout time.Duration `koanf:"connect_timeout" yaml:"connect_timeout"`
	// SessionTimeout is how long the group waits for a member that stopped
	// heartbeating (a replica killed or frozen) before its partitions go
	// to the others; Kafka's session.timeout.ms.
	SessionTimeout time.Duration `koanf:"session_timeout" yaml:"session_timeout"`
	SASLMechanism  string        `koanf:"sasl_mechanism" yaml:"sasl_mechanism"`
	SASLUser       string        `koanf:"sasl_user" yaml:"sasl_user"`
	SASLPassword   string        `koanf:"sasl_password" yaml:"sasl_password" secret:"all"`
	TLS            bool          `koanf:"tls" yaml:"tls"`
	TLSCAFile      string        `koanf:"tls_ca_file" yaml:"tls_ca_file"`
	TLSCertFile    string        `koanf:"tls_cert_file" yaml:"tls_cert_file"`
	TLSKeyFile     string        `koanf:"tls_key_file" yaml:"tls_key_file"`
}

// WebhookSource is an HTTP receiver of Standard Webhooks on an address of
// its own (inbox.sources[].webhook).
type WebhookSource struct {
	Addr string `koanf:"addr" yaml:"addr"`
	Path string `koanf:"path" yaml:"path"`
	// Secret verifies the webhook-signature header: the whsec_ base64
	// secret the sender signs with. Several, space-separated, while a
	// secret is rotated.
	Secret string `koanf:"secret" yaml:"secret" secret:"all"`
	// Tolerance bounds the age of webhook-timestamp, against replays.
	Tolerance time.Duration `koanf:"tolerance" yaml:"tolerance"`
	// MaxBody bounds a request's body, in bytes; larger ones get 413.
	MaxBody int64 `koanf:"max_body" yaml:"max_body"`
	// DuplicateStatus answers a message already processed: 200 (the
	// sender stops) or 409.
	DuplicateStatus int `koanf:"duplicate_status" yaml:"duplicate_status"`
	// Timeout bounds how long a request waits for its work and retries:
	// then no retry starts, and a work transaction under way still runs to
	// its end (at most 2/3 of inbox.lease_ttl).
	Timeout time.Duration `koanf:"timeout" yaml:"timeout"`
	// MaxInFlight bounds the requests served at once; more get 503 with
	// Retry-After. Each waits for a connection of the worker's pool.
	MaxInFlight int `koanf:"max_in_flight" yaml:"max_in_flight"`
}

// DefaultConcurrency is inbox.sources[].concurrency when not set.
const DefaultConcurrency = 4

// DefaultSource is an entry of inbox.sources before its keys are applied:
// every key not given has this value.
func DefaultSource() SourceConfig {
	return SourceConfig{
		Effects: EffectsTransactional,
		// Measured on a loaded 2-core machine only: re-measure with the
		// inbox benchmarks (docs/performance/inbox.md) before tuning.
		Concurrency: DefaultConcurrency,
		NATS: NATSSource{
			URL: "nats://127.0.0.1:4222", Stream: "OUTBOX", AckWait: 5 * time.Second,
			MaxAckPending: 1000, ConnectTimeout: 30 * time.Second,
		},
		// Twice inbox.batch_size: the next batch arrives while one is
		// processed (measured 36% faster than 100).
		RabbitMQ: RabbitMQSource{URL: "amqp://127.0.0.1:5672/", Prefetch: 200, ConnectTimeout: 30 * time.Second},
		Kafka:    KafkaSource{Brokers: "127.0.0.1:9092", ClientID: "worker", ConnectTimeout: 30 * time.Second, SessionTimeout: 45 * time.Second},
		Webhook: WebhookSource{
			Addr: ":8081", Path: "/", Tolerance: 5 * time.Minute, MaxBody: 1 << 20,
			DuplicateStatus: 200, Timeout: 30 * time.Second, MaxInFlight: 64,
		},
	}
}
