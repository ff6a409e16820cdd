package startup

import (
	"context"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/jobs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/tasks"
)

// Extensions are what a program that embeds the worker adds in Go: jobs,
// task kinds and outbox sinks. The zero value adds nothing, which is what
// the stock binary runs.
type Extensions struct {
	// Jobs returns the program's Go jobs, beside jobs.Builtin. It is called
	// with nil to learn their names while the configuration is checked.
	Jobs func(pool *pgxpool.Pool) []jobs.Spec
	// Tasks registers the program's Go task kinds.
	Tasks func(*tasks.Registry) error
	// Sinks are outbox sinks by the outbox.sink name that selects them.
	// new is called once, when the relay starts.
	Sinks map[string]func(ctx context.Context) (outbox.Sink, error)
	// InboxHandlers are Go inbox handlers, by the name that
	// inbox.sources[].handler.kind selects them with.
	InboxHandlers map[string]inbox.Handler
	// OnReady are started, each in a goroutine of its own, when `run` is
	// ready, and never by the other commands. Their ctx is cancelled when
	// shutdown begins; the worker waits for them to return, within the
	// shutdown budget, before it exits.
	OnReady []func(ctx context.Context)
}

// Check refuses extensions that clash with what the worker has built in,
// before any configuration is read: a programming mistake, not an
// operator's, but reported like a configuration error (exit 78).
func (x Extensions) Check() error {
	if x.Jobs != nil {
		if err := jobs.CheckSpecs(x.Jobs(nil)...); err != nil {
			return config.Errorf("%w", err)
		}
	}
	for _, f := range x.OnReady {
		if f == nil {
			return config.Errorf("an OnReady function is nil")
		}
	}
	for _, name := range slices.Sorted(maps.Keys(x.InboxHandlers)) {
		switch {
		case name == inboxconfig.HandlerSQL || name == inboxconfig.HandlerRiver:
			return config.Errorf("inbox handler %q is built into the worker; give the Go handler another name", name)
		case x.InboxHandlers[name] == nil:
			return config.Errorf("inbox handler %q is nil", name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(x.Sinks)) {
		if _, ok := sinkKinds[name]; ok {
			return config.Errorf("sink %q is built into the worker; give the custom sink another name", name)
		}
	}
	return nil
}

// jobNames are the names of the program's Go jobs.
func (x Extensions) jobNames() []string {
	if x.Jobs == nil {
		return nil
	}
	var names []string
	for _, sp := range x.Jobs(nil) {
		if sp.Job != nil {
			names = append(names, sp.Job.Name())
		}
	}
	return names
}
