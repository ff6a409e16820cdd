package inboxconfig

import (
	"fmt"
	"regexp"
	"time"
)

// Config is the `inbox:` section of configs/worker.yaml (APP_INBOX_*).
type Config struct {
	// LeaseTTL is how long a claim holds a message before another replica
	// may take it over (RECEIVED, FAILED) or must hand it to an operator
	// (PROCESSING). A message's work runs for at most 2/3 of it.
	LeaseTTL    time.Duration `koanf:"lease_ttl" yaml:"lease_ttl"`
	MaxAttempts int           `koanf:"max_attempts" yaml:"max_attempts"`
	BackoffBase time.Duration `koanf:"backoff_base" yaml:"backoff_base"`
	// BackoffMax caps the wait between retries. A retry waits in the
	// consumer, holding its delivery (and, for ordered sources, the
	// messages behind it), so the cap is low.
	BackoffMax time.Duration `koanf:"backoff_max" yaml:"backoff_max"`
	// BatchSize bounds the messages a source hands over at once.
	BatchSize int `koanf:"batch_size" yaml:"batch_size"`
	// Retention is how long a finished dedupe record is kept: a duplicate
	// that arrives later is processed again.
	Retention time.Duration `koanf:"retention" yaml:"retention"`
	// ReapInterval and ReapBatch pace the deletion of expired records.
	ReapInterval time.Duration `koanf:"reap_interval" yaml:"reap_interval"`
	ReapBatch    int           `koanf:"reap_batch" yaml:"reap_batch"`
	// ProbeBackoffMax caps the wait between reconnects to a source that is
	// down.
	ProbeBackoffMax time.Duration `koanf:"probe_backoff_max" yaml:"probe_backoff_max"`
	// Sources are the consumers, YAML-only (a list); APP_INBOX_SOURCES_<NAME>_<KEY>
	// overrides one source's scalar keys.
	Sources []SourceConfig `koanf:"sources" yaml:"sources"`
}

// The smallest values of the duration settings. Validate refuses less;
// DurationMinimums lists them by key for docs/configuration.md, which a
// test holds to them.
const (
	MinLeaseTTL        = time.Second
	MinBackoffBase     = time.Millisecond
	MinBackoffMax      = MinBackoffBase // and at least backoff_base
	MinRetention       = time.Minute
	MinReapInterval    = time.Second
	MinProbeBackoffMax = 10 * time.Millisecond
)

// DurationMinimums are the constants above by key (inbox.<key>).
func DurationMinimums() map[string]time.Duration {
	return map[string]time.Duration{
		"inbox.lease_ttl":         MinLeaseTTL,
		"inbox.backoff_base":      MinBackoffBase,
		"inbox.backoff_max":       MinBackoffMax,
		"inbox.retention":         MinRetention,
		"inbox.reap_interval":     MinReapInterval,
		"inbox.probe_backoff_max": MinProbeBackoffMax,
	}
}

// DefaultConfig is the inbox section when nothing is set: no sources.
func DefaultConfig() Config {
	return Config{
		LeaseTTL:        30 * time.Second,
		MaxAttempts:     3,
		BackoffBase:     time.Second,
		BackoffMax:      30 * time.Second,
		BatchSize:       100,
		Retention:       7 * 24 * time.Hour,
		ReapInterval:    time.Minute,
		ReapBatch:       1000,
		ProbeBackoffMax: 5 * time.Second,
	}
}

// Source kinds, the values of inbox.sources[].kind.
const (
	KindNATS     = "nats"
	KindRabbitMQ = "rabbitmq"
	KindKafka    = "kafka"
	KindWebhook  = "webhook"
)

// Handler kinds built in, the values of inbox.sources[].handler.kind; any
// other value names a Go handler registered with worker.WithInboxHandler.
const (
	HandlerSQL   = "sql"
	HandlerRiver = "river"
)

// Handler effects, the values of inbox.sources[].effects.
const (
	EffectsTransactional = "transactional"
	EffectsExternal      = "external"
)

// MaxConcurrency bounds inbox.sources[].concurrency: each lane holds a
// database connection while it works.
const MaxConcurrency = 64

// SourceConfig is one entry of inbox.sources.
type SourceConfig struct {
	// Name identifies the consumer: in metrics (source label), logs, the
	// CLI and the dedupe key. Changing it forgets what was received.
	Name string `koanf:"name" yaml:"name"`
	Kind string `koanf:"kind" yaml:"kind"`
	// Key names where a foreign message keeps its dedupe key, when it has
	// no CloudEvents id: a header ("header:Idempotency-Key") or a top-level
	// JSON field of the body ("field:order_id").
	Key     string        `koanf:"key" yaml:"key"`
	Handler HandlerConfig `koanf:"handler" yaml:"handler"`
	// Effects says where the handler's effects go: "transactional" (all in
	// the work transaction: the claim, the work and PROCESSED commit
	// together, and a crash simply runs the message again) or "external"
	// (it also acts outside the database: the claim commits first, and a
	// crash mid-work hands the message to an operator, RECOVERY_REQUIRED).
	// sql and river handlers are transactional.
	Effects string `koanf:"effects" yaml:"effects"`
	// Concurrency is how many lanes a batch is split into, by a hash of
	// the order key, each worked in a transaction of its own at the same
	// time: messages of one order key share a lane, in the source's order.
	Concurrency int `koanf:"concurrency" yaml:"concurrency"`

	NATS     NATSSource     `koanf:"nats" yaml:"nats"`
	RabbitMQ RabbitMQSource `koanf:"rabbitmq" yaml:"rabbitmq"`
	Kafka    KafkaSource    `koanf:"kafka" yaml:"kafka"`
	Webhook  WebhookSource  `koanf:"webhook" yaml:"webhook"`
}

// HandlerConfig says what a message's work is.
type HandlerConfig struct {
	// Kind is sql, river, or the name of a Go handler.
	Kind string `koanf:"kind" yaml:"kind"`
	// SQL runs for the sql kind, with the message bound as named
	// parameters: @source, @id, @type, @order_key, @origin, @body (text),
	// @body_json (jsonb, NULL when the body is not JSON), @headers (jsonb)
	// and @attempt.
	SQL string `koanf:"sql" yaml:"sql"`
	// TaskKind is the River task kind the river kind enqueues; its args
	// are the message's body (a JSON object) and its metadata the
	// message's key.
	TaskKind string `koanf:"task_kind" yaml:"task_kind"`
	// Queue is the River queue for the river kind; "" is the kind's.
	Queue string `koanf:"queue" yaml:"queue"`
}

var sourceName = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,62}$`)

// Validate checks the scalar keys and each source's common keys; the
// source packages check their own sections.
func (c Config) Validate() error {
	switch {
	case c.LeaseTTL < MinLeaseTTL:
		return fmt.Errorf("inbox.lease_ttl=%s: want at least %s", c.LeaseTTL, MinLeaseTTL)
	case c.MaxAttempts < 1 || c.MaxAttempts > 1000:
		return fmt.Errorf("inbox.max_attempts=%d: want 1 to 1000", c.MaxAttempts)
	case c.BackoffBase < MinBackoffBase:
		return fmt.Errorf("inbox.backoff_base=%s: want at least %s", c.BackoffBase, MinBackoffBase)
	case c.BackoffMax < c.BackoffBase:
		return fmt.Errorf("inbox.backoff_max=%s: want at least inbox.backoff_base (%s)", c.BackoffMax, c.BackoffBase)
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("inbox.batch_size=%d: want 1 to 10000", c.BatchSize)
	case c.Retention < MinRetention:
		return fmt.Errorf("inbox.retention=%s: want at least %s", c.Retention, MinRetention)
	case c.ReapInterval < MinReapInterval:
		return fmt.Errorf("inbox.reap_interval=%s: want at least %s", c.ReapInterval, MinReapInterval)
	case c.ReapBatch < 1 || c.ReapBatch > 100000:
		return fmt.Errorf("inbox.reap_batch=%d: want 1 to 100000", c.ReapBatch)
	case c.ProbeBackoffMax < MinProbeBackoffMax:
		return fmt.Errorf("inbox.probe_backoff_max=%s: want at least %s", c.ProbeBackoffMax, MinProbeBackoffMax)
	}
	seen := map[string]bool{}
	for i, s := range c.Sources {
		at := fmt.Sprintf("inbox.sources[%d]", i)
		switch {
		case !sourceName.MatchString(s.Name):
			return fmt.Errorf("%s.name=%q: want lowercase letters, digits, '-' or '_', starting with a letter, at most 63", at, s.Name)
		case seen[s.Name]:
			return fmt.Errorf("%s.name=%q: another source has this name", at, s.Name)
		}
		seen[s.Name] = true
		if _, err := ParseKey(s.Key); err != nil {
			return fmt.Errorf("%s.key: %w", at, err)
		}
		switch s.Kind {
		case KindNATS, KindRabbitMQ, KindKafka, KindWebhook:
		default:
			return fmt.Errorf("%s.kind=%q: want nats, rabbitmq, kafka or webhook", at, s.Kind)
		}
		switch h := s.Handler; h.Kind {
		case HandlerSQL:
			if h.SQL == "" {
				return fmt.Errorf("%s.handler.sql is empty: the sql handler runs it for each message", at)
			}
		case HandlerRiver:
			if h.TaskKind == "" {
				return fmt.Errorf("%s.handler.task_kind is empty: the river handler enqueues a task of this kind", at)
			}
		case "":
			return fmt.Errorf("%s.handler.kind is empty: want sql, river or a Go handler's name", at)
		}
		switch s.Effects {
		case "", EffectsTransactional:
		case EffectsExternal:
			if s.Handler.Kind == HandlerSQL || s.Handler.Kind == HandlerRiver {
				return fmt.Errorf("%s.effects=%q: a %s handler's effects are all in the work transaction; want transactional (only a Go handler can act outside it)", at, s.Effects, s.Handler.Kind)
			}
		default:
			return fmt.Errorf("%s.effects=%q: want transactional or external", at, s.Effects)
		}
		if s.Concurrency < 1 || s.Concurrency > MaxConcurrency {
			return fmt.Errorf("%s.concurrency=%d: want 1 to %d", at, s.Concurrency, MaxConcurrency)
		}
	}
	return nil
}
