package tasks

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// Options configure a Runtime.
type Options struct {
	Config     tasksconfig.Config // validated
	Pool       *pgxpool.Pool      // River gets a pool of its own, configured like this one
	InstanceID string
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// Register adds the Go task kinds (AddWorker). May be nil.
	Register func(*Registry) error
	// HTTPClient for http kinds; nil means a default one. Redirects are
	// never followed: they would carry the kind's headers elsewhere.
	HTTPClient *http.Client
}

// riverPoolConns is the size of River's pool. It serves River's producers'
// fetches, the completer, leader election and maintenance, and the sql
// tasks running at the moment: each holds one for its run, and waits for
// one when all are taken (http and go tasks hold none of these while they
// run). A fixed size, rather than one connection per worker, keeps a
// replica within its connection budget whatever max_workers says (docs/operations.md,
// "Connections"). River's LISTEN connection is taken from the pool and
// hijacked, so the server sees one more connection than this.
const riverPoolConns = 4

// MaxConns is the most connections the runtime holds: River's pool and its
// LISTEN connection.
const MaxConns = riverPoolConns + 1

// fetchCooldown is the shortest time between two fetches of one queue on
// one replica (River's default is 100ms). A fetch takes at most the
// queue's free max_workers slots, so this caps how fast short tasks drain:
// at River's default, 10 workers ran about 60 tasks/s, and the 2,400 tasks
// an endpoint outage of 2 minutes leaves waiting took 25s to deliver after
// its return. A fetch is one indexed UPDATE, and an idle queue still
// fetches only on a notification or every poll interval.
const fetchCooldown = 20 * time.Millisecond

// deadLetterRetention is how long River keeps dead letters before its
// cleaner deletes them.
const deadLetterRetention = 7 * 24 * time.Hour

// Runtime is the River client as one of the worker's components: Start
// runs it, Shutdown stops it within the shutdown budget.
type Runtime struct {
	cfg     tasksconfig.Config
	goKinds []string // registered in Go, with or without an entry in cfg.Kinds
	log     *slog.Logger
	pool    *pgxpool.Pool
	client  *river.Client[pgx.Tx]
	m       *metrics

	stopRefresh context.CancelFunc
	refreshDone sync.WaitGroup
}

// New builds the River client for the configured queues and kinds. It does
// not touch the database; Start does.
func New(opts Options) (*Runtime, error) {
	cfg := opts.Config
	reg := &Registry{workers: river.NewWorkers()}
	if opts.Register != nil {
		if err := opts.Register(reg); err != nil {
			return nil, fmt.Errorf("tasks: register Go kinds: %w", err)
		}
	}
	// River gets a pool of its own, so tasks (a sql task holds a connection
	// for its whole run) never starve jobs and the relay of connections.
	pcfg := opts.Pool.Config()
	pcfg.MaxConns = riverPoolConns
	pcfg.MinConns, pcfg.MinIdleConns = 0, 0
	pcfg.ConnConfig.RuntimeParams["application_name"] = "worker " + opts.InstanceID + " tasks"
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return nil, err
	}
	goKinds := slices.Clone(reg.kinds)
	kinds := slices.Concat(cfg.KindNames(), goKinds)
	slices.Sort(kinds)
	m, err := newMetrics(opts.Registerer, slices.Compact(kinds), cfg.QueueNames(), cfg.HTTPKindNames())
	if err != nil {
		pool.Close()
		return nil, err
	}
	log := opts.Logger.With("component", "tasks")
	if err := addConfiguredKinds(reg, &cfg, pool, opts.HTTPClient, func(kind string) *endpointBreaker {
		return newEndpointBreaker(kind, m, log, cfg.ProbeBackoffMax)
	}); err != nil {
		pool.Close()
		return nil, err
	}

	queues := make(map[string]river.QueueConfig, len(cfg.Queues))
	for name, q := range cfg.Queues {
		queues[name] = river.QueueConfig{MaxWorkers: q.Workers()}
	}
	rt := &Runtime{cfg: cfg, goKinds: goKinds, log: log, pool: pool, m: m}
	if len(kinds) == 0 {
		return rt, nil // River refuses to run without a worker; nothing to run
	}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		ID: opts.InstanceID,
		// The worker's logger, never River's default, which writes text to
		// stdout (where the log sink writes events).
		Logger:      slog.New(warnAndAbove{log.Handler()}),
		MaxAttempts: cfg.MaxAttempts,
		// The observer applies each kind's timeout (so it can tell a
		// timeout from other errors); River's, the longest of them, only
		// bounds Go workers without a Timeout of their own and tells the
		// rescuer when a running task is overdue. An infinite one would
		// keep a dead replica's tasks from ever being rescued.
		JobTimeout:           cfg.LongestTimeout(),
		RescueStuckJobsAfter: cfg.RescueAfter,
		// Dead letters are discarded or cancelled tasks: keep both as long
		// as River keeps discarded ones (its default for cancelled is 24h).
		CancelledJobRetentionPeriod: deadLetterRetention,
		DiscardedJobRetentionPeriod: deadLetterRetention,
		RetryPolicy:                 retryPolicy{base: cfg.BackoffBase, max: cfg.BackoffMax},
		// A task of a kind this replica does not know stays available,
		// without using up attempts, for a replica that knows it: during a
		// rolling deploy that adds a kind, old replicas leave its tasks
		// alone instead of dead-lettering them.
		FetchOnlyKnownKinds: true,
		FetchCooldown:       fetchCooldown,
		Queues:              queues,
		Workers:             reg.workers,
		Middleware:          []rivertype.Middleware{&observer{cfg: &rt.cfg, log: log, m: m}},
	})
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("tasks: %w", err)
	}
	rt.client = client
	return rt, nil
}

// addConfiguredKinds registers a worker for each http and sql kind, and
// checks that each go kind has one.
func addConfiguredKinds(reg *Registry, cfg *tasksconfig.Config, pool *pgxpool.Pool, client *http.Client, endpoint func(kind string) *endpointBreaker) error {
	httpClient := &http.Client{}
	if client != nil {
		cp := *client
		httpClient = &cp
	}
	httpClient.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	for i, k := range cfg.Kinds {
		registered := slices.Contains(reg.kinds, k.Name)
		if k.Type != tasksconfig.TypeGo && registered {
			return &ConfigError{Msg: fmt.Sprintf("tasks.kinds[%d] %q: type %s, but a Go worker is registered for that kind; use type go", i, k.Name, k.Type)}
		}
		switch k.Type {
		case tasksconfig.TypeHTTP:
			river.AddWorkerArgs(reg.workers, rawArgs{kind: k.Name}, river.Worker[rawArgs](&httpWorker{kind: k, client: httpClient, endpoint: endpoint(k.Name), pool: pool}))
		case tasksconfig.TypeSQL:
			river.AddWorkerArgs(reg.workers, rawArgs{kind: k.Name}, river.Worker[rawArgs](&sqlWorker{kind: k, pool: pool}))
		case tasksconfig.TypeGo:
			if !registered {
				return &ConfigError{Msg: fmt.Sprintf("tasks.kinds[%d] %q: type go, but no Go worker is registered for that kind", i, k.Name)}
			}
		}
	}
	return nil
}

// ConfigError is a configuration the runtime cannot run.
type ConfigError struct{ Msg string }

func (e *ConfigError) Error() string { return e.Msg }

// Start publishes the configuration the enqueue function reads, then starts
// River and the metrics refresh. ctx is not cancelled at SIGTERM; Shutdown
// stops everything.
func (r *Runtime) Start(ctx context.Context) error {
	if err := publishConfig(ctx, r.pool, &r.cfg, r.goKinds...); err != nil {
		return fmt.Errorf("tasks: publish configuration: %w", err)
	}
	for _, name := range r.cfg.QueueNames() {
		if r.cfg.Queues[name].Backlog() == 0 {
			r.log.Warn("task queue has no backlog bound; enqueues are never refused", "queue", name)
		}
	}
	rctx, cancel := context.WithCancel(ctx)
	r.stopRefresh = cancel
	r.refreshDone.Go(func() { r.m.refreshLoop(rctx, r.pool, &r.cfg, r.log) })
	if r.client == nil {
		r.log.Info("no task kinds configured or registered; River is not started")
		return nil
	}
	if err := r.client.Start(ctx); err != nil {
		return fmt.Errorf("tasks: start River: %w", err)
	}
	r.log.Info("tasks started", "queues", r.cfg.QueueNames(), "kinds", r.cfg.KindNames())
	return nil
}

// Shutdown lets running tasks finish until ctx's deadline (the shutdown
// budget minus 1s), then cancels them (StopAndCancel): River makes a
// cancelled task available again without using up its attempt, so it runs
// later, on this replica or another. Then it closes River's pool.
func (r *Runtime) Shutdown(ctx context.Context) error {
	if r.stopRefresh != nil {
		r.stopRefresh()
		r.refreshDone.Wait()
	}
	defer r.pool.Close()
	if r.client == nil {
		return nil
	}
	err := r.client.Stop(ctx)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
		return err
	}
	r.log.Warn("tasks still running at the end of the shutdown budget; cancelling them")
	hard, cancel := context.WithTimeout(context.WithoutCancel(ctx), 500*time.Millisecond)
	defer cancel()
	return r.client.StopAndCancel(hard)
}

// publishConfig writes the kinds' queues and max_attempts and the queues'
// max_backlog where worker_enqueue and Enqueue read them, and removes the
// kinds and queues the configuration no longer has: a kind dropped from it
// would otherwise keep routing its tasks to its old queue, perhaps one no
// replica works any more. A Go kind without an entry under tasks.kinds gets
// the defaults' row, so that every kind this replica runs is known to the
// enqueue paths (worker_task_admit's NOTICE, the CLI's check).
func publishConfig(ctx context.Context, pool *pgxpool.Pool, cfg *tasksconfig.Config, goKinds ...string) error {
	kinds := slices.Clone(cfg.Kinds)
	for _, name := range goKinds {
		if _, ok := cfg.KindNamed(name); !ok {
			kinds = append(kinds, tasksconfig.Kind{Name: name, Queue: tasksconfig.DefaultQueue, MaxAttempts: cfg.MaxAttempts})
		}
	}
	// Rows in one order (stale ones, defaults, then kinds and queues by
	// name), so replicas starting together never deadlock on them.
	slices.SortFunc(kinds, func(a, b tasksconfig.Kind) int { return strings.Compare(a.Name, b.Name) })
	names := make([]string, len(kinds))
	for i, k := range kinds {
		names[i] = k.Name
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue(`DELETE FROM worker_task_kind WHERE kind <> '*' AND kind <> ALL($1)`, names)
		b.Queue(`DELETE FROM worker_task_queue WHERE queue <> ALL($1)`, cfg.QueueNames())
		b.Queue(`INSERT INTO worker_task_kind VALUES ('*', 'default', $1)
			ON CONFLICT (kind) DO UPDATE SET queue = excluded.queue, max_attempts = excluded.max_attempts`, cfg.MaxAttempts)
		for _, k := range kinds {
			b.Queue(`INSERT INTO worker_task_kind VALUES ($1, $2, $3)
				ON CONFLICT (kind) DO UPDATE SET queue = excluded.queue, max_attempts = excluded.max_attempts`, k.Name, k.Queue, k.MaxAttempts)
		}
		for _, name := range cfg.QueueNames() {
			b.Queue(`INSERT INTO worker_task_queue VALUES ($1, $2)
				ON CONFLICT (queue) DO UPDATE SET max_backlog = excluded.max_backlog`, name, cfg.Queues[name].Backlog())
		}
		return tx.SendBatch(ctx, b).Close()
	})
}

// warnAndAbove keeps River's own log lines at warning and above. River logs
// every retry and discard at info, without the task's propagated context;
// the observer logs those, with it. River's ERRORs about a lost database
// connection become WARNs: its services retry by themselves, and the
// worker says once that the database is unreachable (one ERROR per
// outage, not one per River service and attempt).
type warnAndAbove struct{ slog.Handler }

func (h warnAndAbove) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError && connectionLost(r) {
		lowered := slog.NewRecord(r.Time, slog.LevelWarn, r.Message, r.PC)
		r.Attrs(func(a slog.Attr) bool { lowered.AddAttrs(a); return true })
		r = lowered
	}
	return h.Handler.Handle(ctx, r)
}

// connectionLost reports whether r's error (River's "err" or "error"
// attribute, an error or its text) says the database connection was lost,
// or r is the batch completer giving up after its retries, which only a
// database that does not answer makes it do (its tasks are rescued after
// tasks.rescue_after).
func connectionLost(r slog.Record) bool {
	if strings.HasSuffix(r.Message, "Too many errors; giving up") {
		return true
	}
	lost := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key != "err" && a.Key != "error" {
			return true
		}
		if err, ok := a.Value.Any().(error); ok {
			lost = obs.ConnectionLost(err)
		} else {
			lost = obs.ConnectionLostText(a.Value.String())
		}
		return false
	})
	return lost
}

func (h warnAndAbove) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn && h.Handler.Enabled(ctx, l)
}

func (h warnAndAbove) WithAttrs(attrs []slog.Attr) slog.Handler {
	return warnAndAbove{h.Handler.WithAttrs(attrs)}
}

func (h warnAndAbove) WithGroup(name string) slog.Handler {
	return warnAndAbove{h.Handler.WithGroup(name)}
}
