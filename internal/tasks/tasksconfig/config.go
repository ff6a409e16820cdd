// Package tasks runs durable background tasks on River: tasks that
// applications enqueue in their own transactions (SQL function, Go helper,
// CLI) and that a replica of the worker runs once they commit, with retry,
// dead letters, bounded concurrency and context propagation.
package tasksconfig

import (
	"cmp"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"
)

// Kind types: what runs a task kind.
const (
	TypeHTTP = "http" // POST the args to a URL
	TypeSQL  = "sql"  // run a statement, commit it with the task's completion
	TypeGo   = "go"   // a river.Worker registered in code
)

// DefaultQueue is River's default queue; it always exists.
const DefaultQueue = "default"

// Config is the `tasks:` section of the worker's configuration.
type Config struct {
	Enabled         bool          `koanf:"enabled"`
	MaxAttempts     int           `koanf:"max_attempts"`
	BackoffBase     time.Duration `koanf:"backoff_base"`
	BackoffMax      time.Duration `koanf:"backoff_max"`
	Timeout         time.Duration `koanf:"timeout"`
	RescueAfter     time.Duration `koanf:"rescue_after"`
	MetricsInterval time.Duration `koanf:"metrics_interval"`
	// ProbeBackoffMax caps the backoff between probes of an http kind's
	// unavailable endpoint, and the snoozes of its tasks meanwhile: the
	// longest a task waits after the endpoint is back.
	ProbeBackoffMax time.Duration `koanf:"probe_backoff_max"`
	// Queues and Kinds are YAML-only (no APP_* variable).
	Queues map[string]Queue `koanf:"queues"`
	Kinds  []Kind           `koanf:"kinds"`
}

// Queue bounds one River queue. The fields are pointers so that a key left
// out gets its default while an explicit 0 keeps its meaning: raising a
// queue's max_workers must not turn its backlog bound off. Validate fills
// them in.
type Queue struct {
	// MaxWorkers is the most tasks of this queue running at once in one
	// replica.
	MaxWorkers *int `koanf:"max_workers" yaml:"max_workers"`
	// MaxBacklog is the most available (waiting) tasks the queue accepts;
	// an enqueue beyond it is refused with JOB_EXECUTOR_REJECTED. 0 means
	// unbounded.
	MaxBacklog *int `koanf:"max_backlog" yaml:"max_backlog"`
}

// Workers is MaxWorkers, once Validate has filled it in.
func (q Queue) Workers() int { return *q.MaxWorkers }

// Backlog is MaxBacklog, once Validate has filled it in.
func (q Queue) Backlog() int { return *q.MaxBacklog }

// Defaults of a queue's keys, for the default queue and any other.
const (
	defaultMaxWorkers = 10
	defaultMaxBacklog = 10000
)

// Kind is a named task kind configured in YAML.
type Kind struct {
	Name        string        `koanf:"name"`
	Type        string        `koanf:"type"`
	Queue       string        `koanf:"queue"`
	Timeout     time.Duration `koanf:"timeout"`
	MaxAttempts int           `koanf:"max_attempts"`
	// The keys of one type; config print leaves out the others'.
	URL     string            `koanf:"url" yaml:",omitempty"`     // http
	Headers map[string]string `koanf:"headers" yaml:",omitempty"` // http
	SQL     string            `koanf:"sql" yaml:",omitempty"`     // sql
}

// MinDuration is the smallest value of every tasks duration setting:
// any positive one. Further rules relate them (timeout below
// rescue_after, backoff_max at least backoff_base).
const MinDuration = time.Nanosecond

// DurationMinimums are the tasks duration settings by key, each with
// MinDuration, for docs/configuration.md, which a test holds to them.
func DurationMinimums() map[string]time.Duration {
	return map[string]time.Duration{
		"tasks.backoff_base": MinDuration, "tasks.backoff_max": MinDuration, "tasks.timeout": MinDuration,
		"tasks.rescue_after": MinDuration, "tasks.metrics_interval": MinDuration, "tasks.probe_backoff_max": MinDuration,
	}
}

// DefaultConfig holds the scalar defaults. The default queue is added by
// Validate, so a YAML `queues:` section adds queues rather than replacing it.
func DefaultConfig() Config {
	return Config{
		Enabled:         true,
		MaxAttempts:     3,
		BackoffBase:     time.Second,
		BackoffMax:      5 * time.Minute,
		Timeout:         time.Minute,
		RescueAfter:     10 * time.Minute,
		MetricsInterval: 5 * time.Second,
		ProbeBackoffMax: 5 * time.Second,
	}
}

// River's rule for queue names (client.go validateQueueName).
var queueNameRE = regexp.MustCompile(`^(?:[a-z0-9])+(?:[_|\-]?[a-z0-9]+)*$`)

// Validate checks the section and fills in the defaults of queues and kinds.
// Errors name the key as it is written in the YAML file.
func (c *Config) Validate() error {
	if c.MaxAttempts < 1 {
		return fmt.Errorf("tasks.max_attempts=%d must be at least 1", c.MaxAttempts)
	}
	for key, d := range map[string]time.Duration{"tasks.backoff_base": c.BackoffBase, "tasks.backoff_max": c.BackoffMax,
		"tasks.timeout": c.Timeout, "tasks.rescue_after": c.RescueAfter, "tasks.metrics_interval": c.MetricsInterval,
		"tasks.probe_backoff_max": c.ProbeBackoffMax} {
		if d < DurationMinimums()[key] {
			return fmt.Errorf("%s=%s must be positive", key, d)
		}
	}
	if c.Timeout >= c.RescueAfter {
		return fmt.Errorf("tasks.timeout=%s must be shorter than tasks.rescue_after=%s, or a running task would be rescued while it runs", c.Timeout, c.RescueAfter)
	}
	if c.BackoffMax < c.BackoffBase {
		return fmt.Errorf("tasks.backoff_max=%s is shorter than tasks.backoff_base=%s", c.BackoffMax, c.BackoffBase)
	}
	if c.Queues == nil {
		c.Queues = map[string]Queue{}
	}
	if _, ok := c.Queues[DefaultQueue]; !ok {
		c.Queues[DefaultQueue] = Queue{}
	}
	for name, q := range c.Queues {
		if len(name) > 64 || !queueNameRE.MatchString(name) {
			return fmt.Errorf("tasks.queues.%s: queue names are lower-case letters, digits, - and _ (at most 64)", name)
		}
		q.MaxWorkers = cmp.Or(q.MaxWorkers, ptr(defaultMaxWorkers))
		q.MaxBacklog = cmp.Or(q.MaxBacklog, ptr(defaultMaxBacklog))
		if q.Workers() < 1 {
			return fmt.Errorf("tasks.queues.%s.max_workers=%d must be at least 1", name, q.Workers())
		}
		if q.Backlog() < 0 {
			return fmt.Errorf("tasks.queues.%s.max_backlog=%d must be 0 (unbounded) or more", name, q.Backlog())
		}
		c.Queues[name] = q
	}
	seen := map[string]bool{}
	for i := range c.Kinds {
		k := &c.Kinds[i]
		if err := c.validateKind(k); err != nil {
			return fmt.Errorf("tasks.kinds[%d] %q: %w", i, k.Name, err)
		}
		if seen[k.Name] {
			return fmt.Errorf("tasks.kinds[%d] %q: name used twice", i, k.Name)
		}
		seen[k.Name] = true
	}
	return nil
}

func (c *Config) validateKind(k *Kind) error {
	if CheckKindName(k.Name) != nil {
		return errors.New("name: " + KindNameRule)
	}
	k.Queue = cmp.Or(k.Queue, DefaultQueue)
	if _, ok := c.Queues[k.Queue]; !ok {
		return fmt.Errorf("queue %q is not under tasks.queues (have %s)", k.Queue, strings.Join(c.QueueNames(), ", "))
	}
	if k.Timeout < 0 || k.MaxAttempts < 0 {
		return errors.New("timeout and max_attempts must not be negative")
	}
	k.Timeout = cmp.Or(k.Timeout, c.Timeout)
	k.MaxAttempts = cmp.Or(k.MaxAttempts, c.MaxAttempts)
	if k.Timeout >= c.RescueAfter {
		return fmt.Errorf("timeout %s must be shorter than tasks.rescue_after=%s, or a running task would be rescued while it runs", k.Timeout, c.RescueAfter)
	}
	switch k.Type {
	case TypeHTTP:
		u, err := url.Parse(k.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return errors.New("url must be an http:// or https:// URL")
		}
		for name, v := range k.Headers {
			if !validHeaderName(name) || strings.ContainsAny(v, "\r\n\x00") {
				return fmt.Errorf("header %q: invalid name or value", name)
			}
		}
		if k.SQL != "" {
			return errors.New("sql is for type sql")
		}
	case TypeSQL:
		if strings.TrimSpace(k.SQL) == "" {
			return errors.New("type sql needs sql (one statement; $1 is the task's args as jsonb)")
		}
		if k.URL != "" || len(k.Headers) > 0 {
			return errors.New("url and headers are for type http")
		}
	case TypeGo:
		if k.URL != "" || len(k.Headers) > 0 || k.SQL != "" {
			return errors.New("type go takes only queue, timeout and max_attempts; its code is registered in Go")
		}
	default:
		return fmt.Errorf("type %q; want %s, %s or %s", k.Type, TypeHTTP, TypeSQL, TypeGo)
	}
	return nil
}

// QueueNames returns the configured queue names, sorted.
func (c *Config) QueueNames() []string {
	names := make([]string, 0, len(c.Queues))
	for n := range c.Queues {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// HTTPKindNames returns the names of the http kinds.
func (c *Config) HTTPKindNames() []string {
	var names []string
	for _, k := range c.Kinds {
		if k.Type == TypeHTTP {
			names = append(names, k.Name)
		}
	}
	return names
}

// KindNames returns the configured kind names, in configuration order.
func (c *Config) KindNames() []string {
	names := make([]string, 0, len(c.Kinds))
	for _, k := range c.Kinds {
		names = append(names, k.Name)
	}
	return names
}

// TotalWorkers is the sum of max_workers over the queues: the most tasks
// one replica runs at once.
func (c *Config) TotalWorkers() int {
	n := 0
	for _, q := range c.Queues {
		n += q.Workers()
	}
	return n
}

// LongestTimeout is the longest timeout any kind has.
func (c *Config) LongestTimeout() time.Duration {
	longest := c.Timeout
	for _, k := range c.Kinds {
		longest = max(longest, k.Timeout)
	}
	return longest
}

// KindNamed returns the kind called name under tasks.kinds.
func (c *Config) KindNamed(name string) (Kind, bool) {
	i := slices.IndexFunc(c.Kinds, func(k Kind) bool { return k.Name == name })
	if i < 0 {
		return Kind{}, false
	}
	return c.Kinds[i], true
}

func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for _, r := range name {
		if r > 126 || r <= 32 || strings.ContainsRune(`"(),/:;<=>?@[\]{}`, r) {
			return false
		}
	}
	return http.CanonicalHeaderKey(name) != "Host"
}

func ptr[T any](v T) *T { return &v }
