package startup

import (
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/go-viper/mapstructure/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/knadh/koanf/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	kafkasource "github.com/worker-dev/worker/internal/inbox/source/kafka"
	natssource "github.com/worker-dev/worker/internal/inbox/source/nats"
	rabbitsource "github.com/worker-dev/worker/internal/inbox/source/rabbitmq"
	webhooksource "github.com/worker-dev/worker/internal/inbox/source/webhook"
)

// inboxSourcesKey is the YAML-only list of inbox sources.
const inboxSourcesKey = "inbox.sources"

// inboxSourcesEnvPrefix starts the variables of one source's keys,
// APP_INBOX_SOURCES_<NAME>_<KEY>.
const inboxSourcesEnvPrefix = "APP_INBOX_SOURCES_"

// sourceKinds builds an inbox source of each kind, without connecting:
// NewRunner's sources connect when they run. reg takes a source's own
// metrics; nil when the source is built only to check its section.
var sourceKinds = map[string]func(src inbox.SourceConfig, cfg inbox.Config, log *slog.Logger, reg prometheus.Registerer) (inbox.Source, error){
	inbox.KindNATS: func(src inbox.SourceConfig, cfg inbox.Config, log *slog.Logger, _ prometheus.Registerer) (inbox.Source, error) {
		return natssource.New(src, cfg, log)
	},
	inbox.KindKafka: func(src inbox.SourceConfig, cfg inbox.Config, log *slog.Logger, _ prometheus.Registerer) (inbox.Source, error) {
		return kafkasource.New(src, cfg, log)
	},
	inbox.KindRabbitMQ: func(src inbox.SourceConfig, cfg inbox.Config, _ *slog.Logger, _ prometheus.Registerer) (inbox.Source, error) {
		return rabbitsource.New(src.RabbitMQ, rabbitsource.Options{Name: src.Name, BatchSize: cfg.BatchSize, ProbeBackoffMax: cfg.ProbeBackoffMax})
	},
	inbox.KindWebhook: func(src inbox.SourceConfig, _ inbox.Config, log *slog.Logger, reg prometheus.Registerer) (inbox.Source, error) {
		return webhooksource.New(src.Webhook, webhooksource.Options{
			Name: src.Name, Key: src.Key, MaxInFlight: src.Webhook.MaxInFlight, Logger: log, Registerer: reg,
		})
	},
}

// loadInboxSources reads inbox.sources: each entry starts from
// inbox.DefaultSource, then its YAML keys, then its environment variables,
// APP_INBOX_SOURCES_<NAME>_<KEY> (name upper-cased, '-' as '_'; key as in
// the entry, '.' as '_'), so that a secret never has to be in the file.
func loadInboxSources(k *koanf.Koanf, environ []string) ([]inbox.SourceConfig, error) {
	raw := k.Get(inboxSourcesKey)
	if raw == nil {
		return nil, nil
	}
	list, ok := raw.([]any)
	if !ok {
		return nil, configErrorf("%s must be a list of source entries", inboxSourcesKey)
	}
	keys := flatten("", reflect.ValueOf(inbox.DefaultSource()))
	var out []inbox.SourceConfig
	for i, entry := range list {
		s := inbox.DefaultSource()
		if err := decodeInto(entry, &s); err != nil {
			return nil, configErrorf("%s[%d]: %w", inboxSourcesKey, i, err)
		}
		prefix := inboxSourcesEnvPrefix + strings.ToUpper(strings.ReplaceAll(s.Name, "-", "_")) + "_"
		over := map[string]any{}
		for _, kv := range environ {
			name, v, _ := strings.Cut(kv, "=")
			rest, ok := strings.CutPrefix(name, prefix)
			if !ok || s.Name == "" {
				continue
			}
			key := ""
			for _, st := range keys {
				k := strings.TrimPrefix(st.Key, ".")
				if strings.ToUpper(strings.ReplaceAll(k, ".", "_")) == rest {
					key = k
				}
			}
			if key == "" {
				return nil, configErrorf("%s is not a key of inbox source %q", name, s.Name)
			}
			if f, ok := fieldByKey(reflect.TypeFor[inbox.SourceConfig](), key); ok {
				if problem := valueProblem(f.Type, v); problem != "" {
					return nil, configErrorf("%s=%s %s", name, shownValue(f, v), problem)
				}
			}
			setPath(over, strings.Split(key, "."), v)
		}
		if len(over) > 0 {
			if err := decodeInto(over, &s); err != nil {
				return nil, configErrorf("%s[%d] (%s*): %w", inboxSourcesKey, i, prefix, err)
			}
		}
		out = append(out, s)
	}
	return out, nil
}

// decodeInto decodes a YAML or environment map onto v, keeping the
// fields it does not name, and refusing keys v does not have.
func decodeInto(in any, v any) error {
	dec, err := mapstructure.NewDecoder(&mapstructure.DecoderConfig{
		DecodeHook:       mapstructure.StringToTimeDurationHookFunc(),
		WeaklyTypedInput: true,
		ErrorUnused:      true,
		Result:           v,
		TagName:          "koanf",
	})
	if err != nil {
		return err
	}
	return dec.Decode(in)
}

func setPath(m map[string]any, path []string, v string) {
	for _, p := range path[:len(path)-1] {
		next, ok := m[p].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[p] = next
		}
		m = next
	}
	m[path[len(path)-1]] = v
}

// validateInboxSources checks what run needs of each inbox source beyond
// its form (inbox.Config.Validate): its handler (a Go handler must be
// registered), and its own section, by building it, which wants its
// credentials.
func (c *Config) validateInboxSources() error {
	for i, s := range c.Inbox.Sources {
		switch s.Handler.Kind {
		case inbox.HandlerSQL, inbox.HandlerRiver:
		default:
			if _, ok := c.ext.InboxHandlers[s.Handler.Kind]; !ok {
				return configErrorf("%s[%d].handler.kind=%q: want sql, river, or a Go handler registered with worker.WithInboxHandler (have %s)",
					inboxSourcesKey, i, s.Handler.Kind, strings.Join(c.ext.inboxHandlerNames(), ", "))
			}
		}
		build, ok := sourceKinds[s.Kind]
		if !ok { // Validate named the kinds; this build may lack one
			return configErrorf("%s[%d].kind=%q: this build of the worker has no %s source", inboxSourcesKey, i, s.Kind, s.Kind)
		}
		if _, err := build(s, c.Inbox, slog.New(slog.DiscardHandler), nil); err != nil {
			return configErrorf("%s[%d] (%s): %w", inboxSourcesKey, i, s.Name, err)
		}
	}
	return nil
}

// inboxHandler returns the handler of source s.
func (c *Config) inboxHandler(s inbox.SourceConfig) inbox.Handler {
	switch s.Handler.Kind {
	case inbox.HandlerSQL:
		return inbox.SQLHandler{SQL: s.Handler.SQL}
	case inbox.HandlerRiver:
		return inbox.RiverHandler{Kind: s.Handler.TaskKind, Queue: s.Handler.Queue}
	}
	return c.ext.InboxHandlers[s.Handler.Kind]
}

// newInbox builds the inbox runner of the configured sources, or nil when
// there are none.
func newInbox(cfg *Config, pool *pgxpool.Pool, log *slog.Logger, reg prometheus.Registerer) (*inbox.Runner, error) {
	if len(cfg.Inbox.Sources) == 0 {
		return nil, nil
	}
	m, err := inbox.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	var parts []inbox.Part
	for _, s := range cfg.Inbox.Sources {
		src, err := sourceKinds[s.Kind](s, cfg.Inbox, log.With("inbox_source", s.Name), reg)
		if err != nil {
			return nil, configErrorf("%s (%s): %w", inboxSourcesKey, s.Name, err)
		}
		parts = append(parts, inbox.Part{Config: s, Source: src, Handler: cfg.inboxHandler(s)})
	}
	return inbox.NewRunner(pool, cfg.Inbox, parts, cfg.Instance.ID, log, m), nil
}

func (x Extensions) inboxHandlerNames() []string {
	names := slices.Sorted(maps.Keys(x.InboxHandlers))
	if len(names) == 0 {
		return []string{"none"}
	}
	return names
}
