package startup

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/lock"
	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/opsserver"
)

// component is a long-running part of the worker (the job scheduler, the
// outbox relay). Shutdown stops new work, lets in-flight work finish until
// ctx's deadline, then cancels it and hands back claims and leases.
type component interface {
	Start(ctx context.Context) error
	Shutdown(ctx context.Context) error
}

// defaultGCPercent is the garbage collector's target when GOGC is not set.
// The worker's live heap is small and nearly everything it allocates lives
// for one event, so at Go's default of 100 the collector takes a sixth to
// a quarter of the worker's CPU under load. 200 halves its cycles for a
// few more megabytes of heap (docs/performance/relay.md, "Garbage collection").
const defaultGCPercent = 200

// tuneGC applies defaultGCPercent unless the operator set GOGC, which the
// runtime has already applied (as it does GOMEMLIMIT).
func tuneGC() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(defaultGCPercent)
	}
}

// Run is `worker run`: it builds the parts from the configuration, runs
// them until SIGTERM or SIGINT, and stops them within the shutdown budget.
func Run(e Env) error {
	tuneGC()
	cfg, err := e.loadConfig(config.CheckAll)
	if err != nil {
		return err
	}
	log, err := newLogger(e, cfg)
	if err != nil {
		return err
	}
	// A misspelt variable is warned about after the startup line, or, when
	// the worker stops before that line, before the reason it stops: the
	// typo may be why.
	if err := cmp.Or(CheckLockProvider(cfg), cfg.CheckUI()); err != nil {
		warnMisspeltEnv(log, cfg)
		return err
	}
	stopTracing, err := startTracing(e.Environ, cfg, log)
	if err != nil {
		warnMisspeltEnv(log, cfg)
		return err
	}
	defer stopTracing()

	// Signals are watched from the start, so SIGTERM during a slow database
	// connect ends the wait instead of being lost.
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() {
		s := <-sigs
		log.Info("shutdown requested", "signal", s.String(), "budget", cfg.Shutdown.Timeout.String())
		stop()
		s = <-sigs
		log.Warn("second signal, exiting at once", "signal", s.String())
		os.Exit(ExitInterrupted)
	}()

	reg := obs.NewRegistry()
	ready := &opsserver.Readiness{}
	registerOpsMetrics(reg, ready)
	ui, servers, err := newServers(cfg, reg, ready, log)
	if err != nil {
		warnMisspeltEnv(log, cfg)
		return err
	}
	// After the checks that fail at once, which log their one fatal line
	// alone.
	logStartup(log, cfg, config.File(e.ConfigPath))
	warnMisspeltEnv(log, cfg)
	for _, s := range servers {
		go s.serve(log)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		for _, s := range servers {
			_ = s.srv.Shutdown(sctx)
		}
	}()

	pool, err := connectDB(ctx, cfg, log)
	if err != nil {
		if ctx.Err() != nil {
			return nil // asked to stop while still connecting: a clean exit
		}
		return err
	}
	defer closeBounded(pool, time.Second, log)
	probePool, err := opsserver.NewProbePool(pool, cfg.Instance.ID)
	if err != nil {
		return err
	}
	defer closeBounded(probePool, time.Second, log)
	ready.UseDB(probePool)

	if err := checkSchemaAhead(ctx, pool, cfg); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	if cfg.Database.MigrateOnStart {
		if err := migrate.Up(ctx, pool, log); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return migrateError(cfg, err)
		}
	}
	dbh := &dbHealth{pool: probePool, log: log}
	_ = dbh.Start(ctx)
	defer func() { _ = dbh.Shutdown(context.Background()) }()
	schema := &schemaGuard{pool: probePool, log: log}
	schema.start()
	defer schema.shutdown()
	ready.Add(schema)

	checkStore := lock.CheckStore
	if cfg.Lock.Provider == config.ProviderRedis {
		checkStore = lock.CheckFenceStore // the leases live in Redis, their fence here
	}
	if err := CheckLockStore(ctx, cfg, func(ctx context.Context) error { return checkStore(ctx, pool) }); err != nil {
		if ctx.Err() != nil {
			return nil // SIGTERM while checking: not an unsafe setup
		}
		return err
	}
	if cfg.Lock.Provider == config.ProviderPostgres {
		warnAsyncCommit(ctx, pool, log)
	}
	parts, cleanup, err := wire(ctx, cfg, pool, log, reg, e.Stdout)
	defer cleanup()
	if err != nil {
		if ctx.Err() != nil {
			return nil // asked to stop while connecting to the broker
		}
		return err
	}
	for _, p := range parts {
		if r, ok := p.(opsserver.ReadyReporter); ok {
			ready.Add(r)
		}
	}
	if ui != nil {
		part, err := ui.attach(pool, log)
		if err != nil {
			return fmt.Errorf("river UI: %w", err)
		}
		parts = append(parts, part)
	}
	// Components get a context that SIGTERM does not cancel: for the outbox
	// relay, cancelling Start's ctx is a hard stop that cuts off publishes in
	// flight. SIGTERM reaches them through Shutdown, which gives in-flight
	// work the budget.
	runCtx := context.WithoutCancel(ctx)
	for _, p := range parts {
		if err := p.Start(runCtx); err != nil {
			// All of them: the one that failed may own goroutines too (the
			// scheduler's gocron), and Shutdown of a component that never
			// started only stops those.
			shutdownAll(parts, cfg.Shutdown.Timeout-time.Second, log)
			return fmt.Errorf("start: %w", err)
		}
	}
	ready.Started()
	log.Info("worker ready", append([]any{"http_addr", cfg.HTTP.Addr, "multi_instance", cfg.MultiInstance.Enabled,
		"lock_provider", cfg.Lock.Provider}, whereToLook(servers)...)...)
	hooks := startOnReady(ctx, e.Ext.OnReady)

	<-ctx.Done()
	ready.Draining()
	deadline := time.Now().Add(cfg.Shutdown.Timeout - time.Second)
	// In-flight work gets the budget minus 1s; the last second is for
	// handing back claims and leases and closing the pool.
	shutdownAll(parts, cfg.Shutdown.Timeout-time.Second, log)
	select {
	case <-hooks:
	case <-time.After(time.Until(deadline)):
		log.Warn("an OnReady function did not return within the shutdown budget; exiting without it")
	}
	log.Info("worker stopped")
	return nil
}

// startOnReady starts an embedding program's OnReady functions and
// returns a channel closed when all of them have returned.
func startOnReady(ctx context.Context, fns []func(context.Context)) <-chan struct{} {
	var wg sync.WaitGroup
	for _, f := range fns {
		wg.Go(func() { f(ctx) })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	return done
}

// listening is a server with its bound listener.
type listening struct {
	srv  *http.Server
	ln   net.Listener
	name string
	ui   bool // River UI is served here
}

func (l listening) serve(log *slog.Logger) {
	if err := l.srv.Serve(l.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Error(l.name+" HTTP server stopped", "error", err)
	}
}

// newServers binds the ops server and, with ui.addr set, River UI's own
// server; the UI is then not on the ops server. ui is nil when the UI is
// off.
func newServers(cfg *runConfig, reg *prometheus.Registry, ready *opsserver.Readiness, log *slog.Logger) (*uiMount, []listening, error) {
	var ui *uiMount
	var guarded http.Handler
	if cfg.UI.Enabled {
		ui = &uiMount{}
		guarded = opsserver.GuardUI(cfg.UI, ui, log)
	}
	opsUI := guarded
	if cfg.UI.Addr != "" {
		opsUI = nil
	}
	srv := opsserver.New(cfg.HTTP.Addr, reg, ready, opsUI, cfg.HTTP.Pprof)
	ln, err := srv.Listen()
	if err != nil {
		return nil, nil, &ExitError{Code: ExitOSError, Err: err, Msg: fmt.Sprintf("ops HTTP server on %s (APP_HTTP_ADDR): %v", cfg.HTTP.Addr, err)}
	}
	servers := []listening{{srv: srv.Server, ln: ln, name: "ops", ui: opsUI != nil}}
	if guarded != nil && cfg.UI.Addr != "" {
		uiSrv := opsserver.NewUI(cfg.UI.Addr, guarded)
		uiLn, err := uiSrv.Listen()
		if err != nil {
			_ = ln.Close()
			return nil, nil, &ExitError{Code: ExitOSError, Err: err, Msg: fmt.Sprintf("River UI server on %s (APP_UI_ADDR): %v", cfg.UI.Addr, err)}
		}
		servers = append(servers, listening{srv: uiSrv.Server, ln: uiLn, name: "River UI", ui: true})
	}
	return ui, servers, nil
}

// whereToLook are the ready line's URLs, from the addresses bound (so an
// addr of port 0 shows the port taken): the ops server, its /metrics, and
// River UI's when it is on.
func whereToLook(servers []listening) []any {
	var attrs []any
	for _, s := range servers {
		base := "http://" + browsable(s.ln.Addr())
		if s.name == "ops" {
			attrs = append(attrs, "ops_url", base, "metrics_url", base+"/metrics")
		}
		if s.ui {
			attrs = append(attrs, "riverui_url", base+opsserver.UIPrefix+"/")
		}
	}
	return attrs
}

// browsable is a listener's address as a browser on the same machine
// reaches it: a wildcard host (":9090") becomes localhost.
func browsable(a net.Addr) string {
	host, port, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "localhost"
	}
	return net.JoinHostPort(host, port)
}

// shutdownAll stops the components in parallel within budget.
func shutdownAll(parts []component, budget time.Duration, log *slog.Logger) {
	sctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Go(func() {
			if err := p.Shutdown(sctx); err != nil {
				log.Warn("shutdown incomplete", "error", err)
			}
		})
	}
	wg.Wait()
}

func newLogger(e Env, cfg *runConfig) (*slog.Logger, error) {
	log, err := obs.NewLogger(e.Stderr, cfg.Log.Format, cfg.Log.Level, cfg.Instance.ID)
	if err != nil {
		return nil, config.Errorf("%w", err)
	}
	if e.OnLogger != nil {
		e.OnLogger(log)
	}
	return log, nil
}

// warnMisspeltEnv warns about each APP_* variable that is no setting but
// nearly names one: the setting meant was not applied.
func warnMisspeltEnv(log *slog.Logger, cfg *runConfig) {
	for _, m := range cfg.MisspeltEnv() {
		log.Warn("environment variable " + m)
	}
}

// closeBounded closes the pool without letting a stuck connection hold the
// exit past the shutdown budget.
func closeBounded(pool *pgxpool.Pool, limit time.Duration, log *slog.Logger) {
	done := make(chan struct{})
	go func() { pool.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(limit):
		log.Warn("database pool did not close in time")
	}
}
