package startup

import (
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/jobs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	riversink "github.com/worker-dev/worker/internal/outbox/sink/river"
)

// runConfig is the configuration with what an embedding program adds (jobs,
// task kinds, sinks, inbox handlers): what the wiring builds from.
type runConfig struct {
	*config.Config
	ext Extensions
}

// LoadConfig is loadConfig for the stock binary.
func LoadConfig(path string, environ []string) (*runConfig, error) {
	return loadConfig(path, environ, Extensions{})
}

// loadConfig reads the configuration as run needs it.
func loadConfig(path string, environ []string, ext Extensions) (*runConfig, error) {
	return readConfig(path, environ, ext, config.CheckAll)
}

// readConfig reads the configuration and checks what a command of the
// given level needs: at CheckAll, each part run builds is built once
// without connecting (checkParts).
func readConfig(path string, environ []string, ext Extensions, level config.Level) (*runConfig, error) {
	c, err := config.Read(path, environ, config.Options{
		Level: level,
		DatabaseURL: func(url string) error {
			_, err := pgxpool.ParseConfig(url)
			return err
		},
		TakenJobNames: takenJobNames(ext),
		Parts:         func(c *config.Config, _ func(string) string) error { return checkParts(c, ext) },
	})
	if err != nil {
		return nil, err
	}
	return &runConfig{Config: c, ext: ext}, nil
}

// takenJobNames are the worker's own jobs and the program's: they share
// the name space of the configured jobs, since the name is the lock key.
func takenJobNames(ext Extensions) []string {
	names := []string{outbox.PartitionsJobName, lockReaperName}
	for _, sp := range jobs.Builtin(nil) {
		names = append(names, sp.Job.Name())
	}
	return append(names, ext.jobNames()...)
}

// checkParts builds what run builds from the configuration, without
// connecting: the Redis lock client, the outbox sink, the inbox sources
// and the river sink's routes.
func checkParts(c *config.Config, ext Extensions) error {
	if c.Lock.Provider == config.ProviderRedis {
		// Its options read the TLS files, a client key among them: run's.
		if _, err := redisOptions(c.Lock.Redis, c.Instance.ID); err != nil {
			return config.Errorf("%v", err)
		}
	}
	if err := validateSink(c.Outbox, ext); err != nil {
		return err
	}
	if err := validateInboxSources(c, ext); err != nil {
		return err
	}
	if c.Outbox.Sink == outboxconfig.SinkRiver {
		if _, err := riversink.New(c.Tasks, c.Outbox.River.Routes); err != nil {
			return config.Errorf("%v", err)
		}
	}
	return nil
}

// validateInboxSources checks what run needs of each inbox source beyond
// its form (inboxconfig.Config.Validate): its handler (a Go handler must be
// registered), and its own section, by building it, which wants its
// credentials.
func validateInboxSources(c *config.Config, ext Extensions) error {
	for i, s := range c.Inbox.Sources {
		switch s.Handler.Kind {
		case inboxconfig.HandlerSQL, inboxconfig.HandlerRiver:
		default:
			if _, ok := ext.InboxHandlers[s.Handler.Kind]; !ok {
				return config.Errorf("%s[%d].handler.kind=%q: want sql, river, or a Go handler registered with worker.WithInboxHandler (have %s)",
					config.InboxSourcesKey, i, s.Handler.Kind, strings.Join(ext.inboxHandlerNames(), ", "))
			}
		}
		build, ok := sourceKinds[s.Kind]
		if !ok { // Validate named the kinds; this build may lack one
			return config.Errorf("%s[%d].kind=%q: this build of the worker has no %s source", config.InboxSourcesKey, i, s.Kind, s.Kind)
		}
		if _, err := build(s, c.Inbox, slog.New(slog.DiscardHandler), nil); err != nil {
			return config.Errorf("%s[%d] (%s): %w", config.InboxSourcesKey, i, s.Name, err)
		}
	}
	return nil
}
