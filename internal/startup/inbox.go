package startup

import (
	"log/slog"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	kafkasource "github.com/worker-dev/worker/internal/inbox/source/kafka"
	natssource "github.com/worker-dev/worker/internal/inbox/source/nats"
	rabbitsource "github.com/worker-dev/worker/internal/inbox/source/rabbitmq"
	webhooksource "github.com/worker-dev/worker/internal/inbox/source/webhook"
)

// sourceKinds builds an inbox source of each kind, without connecting:
// NewRunner's sources connect when they run. reg takes a source's own
// metrics; nil when the source is built only to check its section.
var sourceKinds = map[string]func(src inboxconfig.SourceConfig, cfg inboxconfig.Config, log *slog.Logger, reg prometheus.Registerer) (inbox.Source, error){
	inboxconfig.KindNATS: func(src inboxconfig.SourceConfig, cfg inboxconfig.Config, log *slog.Logger, _ prometheus.Registerer) (inbox.Source, error) {
		return natssource.New(src, cfg, log)
	},
	inboxconfig.KindKafka: func(src inboxconfig.SourceConfig, cfg inboxconfig.Config, log *slog.Logger, _ prometheus.Registerer) (inbox.Source, error) {
		return kafkasource.New(src, cfg, log)
	},
	inboxconfig.KindRabbitMQ: func(src inboxconfig.SourceConfig, cfg inboxconfig.Config, _ *slog.Logger, _ prometheus.Registerer) (inbox.Source, error) {
		return rabbitsource.New(src.RabbitMQ, rabbitsource.Options{Name: src.Name, BatchSize: cfg.BatchSize, ProbeBackoffMax: cfg.ProbeBackoffMax})
	},
	inboxconfig.KindWebhook: func(src inboxconfig.SourceConfig, _ inboxconfig.Config, log *slog.Logger, reg prometheus.Registerer) (inbox.Source, error) {
		return webhooksource.New(src.Webhook, webhooksource.Options{
			Name: src.Name, Key: src.Key, MaxInFlight: src.Webhook.MaxInFlight, Logger: log, Registerer: reg,
		})
	},
}

// inboxHandler returns the handler of source s.
func (c *runConfig) inboxHandler(s inboxconfig.SourceConfig) inbox.Handler {
	switch s.Handler.Kind {
	case inboxconfig.HandlerSQL:
		return inbox.SQLHandler{SQL: s.Handler.SQL}
	case inboxconfig.HandlerRiver:
		return inbox.RiverHandler{Kind: s.Handler.TaskKind, Queue: s.Handler.Queue}
	}
	return c.ext.InboxHandlers[s.Handler.Kind]
}

// newInbox builds the inbox runner of the configured sources, or nil when
// there are none.
func newInbox(cfg *runConfig, pool *pgxpool.Pool, log *slog.Logger, reg prometheus.Registerer) (*inbox.Runner, error) {
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
			return nil, config.Errorf("%s (%s): %w", config.InboxSourcesKey, s.Name, err)
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
