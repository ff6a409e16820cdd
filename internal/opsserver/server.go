// Package opsserver is the ops HTTP server: /metrics, /livez, /readyz and
// River UI behind its guard, each connection bounded in time and number.
package opsserver

import (
	"context"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/worker-dev/worker/internal/migrate"
)

// readyCheckEvery is how long one database check answers /readyz: a probe
// flood costs the database at most one ping a second.
const readyCheckEvery = time.Second

// Readiness decides /readyz from the worker's own state only: started, not
// draining, the database reachable and the migrations current. A sink's
// broker is not part of it: a broker outage would turn every replica
// NotReady at once and let Kubernetes drain healthy ones, while the relay
// holds the events until the broker returns; outbox_sink_up reports it.
type Readiness struct {
	started  atomic.Bool
	draining atomic.Bool
	// db is the probe's own one-connection pool, so a probe never waits
	// for (or takes) a connection the relay and jobs need.
	db atomic.Pointer[pgxpool.Pool]

	// parts are the components that can make the replica not ready on
	// their own (the schema guard, the lock provider's health). Each
	// answers from state it keeps, at no cost to a probe.
	parts atomic.Pointer[[]ReadyReporter]

	mu        sync.Mutex
	checkedAt time.Time
	dbState   string // "ok", or why the database is not ready; cached for readyCheckEvery
	migrated  bool   // sticky once seen current: migrations never go back
}

// Started marks the start done: from now the replica may be ready.
func (r *Readiness) Started() { r.started.Store(true) }

// Draining marks the shutdown begun: the replica is not ready again.
func (r *Readiness) Draining() { r.draining.Store(true) }

// UseDB sets the probe's own pool (NewProbePool).
func (r *Readiness) UseDB(pool *pgxpool.Pool) { r.db.Store(pool) }

// Check is what /readyz answers: ready or not, and why.
func (r *Readiness) Check(ctx context.Context) (bool, string) {
	switch {
	case r.draining.Load():
		return false, "draining"
	case !r.started.Load():
		return false, "starting"
	}
	state := r.database(ctx)
	if state != "ok" {
		return false, state
	}
	if parts := r.parts.Load(); parts != nil {
		for _, p := range *parts {
			if ok, why := p.Ready(); !ok {
				return false, why
			}
		}
	}
	return true, state
}

// ReadyReporter is a part of the worker with a say in /readyz: ok, or why
// not.
type ReadyReporter interface {
	Ready() (ok bool, why string)
}

// Add gives p a say in /readyz. Not safe to call concurrently with itself:
// run adds the parts one after the other, before it reports ready.
func (r *Readiness) Add(p ReadyReporter) {
	var parts []ReadyReporter
	if old := r.parts.Load(); old != nil {
		parts = append(parts, *old...)
	}
	parts = append(parts, p)
	r.parts.Store(&parts)
}

// database answers from the last check while it is fresh; concurrent
// callers wait for the one check in progress rather than start their own.
func (r *Readiness) database(ctx context.Context) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.checkedAt.IsZero() && time.Since(r.checkedAt) < readyCheckEvery {
		return r.dbState
	}
	// Not the caller's context: a probe that gives up early must not leave
	// "database unreachable" cached for everyone else.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	r.dbState = r.checkDatabase(ctx)
	r.checkedAt = time.Now()
	return r.dbState
}

func (r *Readiness) checkDatabase(ctx context.Context) string {
	pool := r.db.Load()
	if err := pool.Ping(ctx); err != nil {
		return "database unreachable"
	}
	if !r.migrated {
		pending, err := migrate.Pending(ctx, pool)
		if err != nil || pending {
			return "migrations pending"
		}
		r.migrated = true
	}
	return "ok"
}

// ProbePoolConns is the readiness check's pool: one connection, opened on
// first use, beside the worker's pool.
const ProbePoolConns = 1

// NewProbePool is the readiness check's pool beside pool, named apart in
// pg_stat_activity.
func NewProbePool(pool *pgxpool.Pool, instanceID string) (*pgxpool.Pool, error) {
	cfg := pool.Config()
	cfg.MaxConns = ProbePoolConns
	cfg.MinConns, cfg.MinIdleConns = 0, 0
	cfg.ConnConfig.RuntimeParams["application_name"] = "worker " + instanceID + " probes"
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

// Ops server limits. An ops request is a probe, a scrape or a River UI
// call: small heads, small bodies, quick answers, except a large scrape
// on a slow network.
const (
	opsReadHeaderTimeout = 5 * time.Second
	opsReadTimeout       = 10 * time.Second
	opsWriteTimeout      = 30 * time.Second
	opsIdleTimeout       = 60 * time.Second // above Prometheus' usual 30s interval, so scrapes reuse their connection
	opsMaxHeaderBytes    = 16 << 10
	// opsMaxScrapes bounds concurrent /metrics answers: each one gathers
	// every series, and thousands at once took the heap to hundreds of
	// megabytes. Beyond it a scrape answers 503 at once.
	opsMaxScrapes = 4
	// opsMaxConns bounds open connections, and opsHeadGrace is the time a
	// new one has to send its request head before a newer one may shed it
	// (see connLimiter). Each connection costs 20–50 KB at a flood's peak:
	// 4096 took the worker past 150 MB, 1024 keep it near 70 MB. A probe
	// behind a burst of stalled heads waits about burst ÷ opsMaxConns ×
	// opsHeadGrace, 0.5 s behind 5,000; a client on the cluster's network
	// sends its head well within the grace.
	opsMaxConns  = 1024
	opsHeadGrace = 100 * time.Millisecond
)

// New serves metrics and probes, River UI when ui is not nil, and Go's
// profiles with profiling.
func New(addr string, reg *prometheus.Registry, ready *Readiness, ui http.Handler, profiling bool) *Server {
	mux := http.NewServeMux()
	if ui != nil {
		mux.Handle(UIPrefix+"/", ui)
	}
	if profiling {
		serveProfiles(mux)
	}
	// OpenMetrics, to a scraper that asks for it, carries the duration
	// histograms' exemplars: the trace ids of traced runs.
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg, MaxRequestsInFlight: opsMaxScrapes,
		EnableOpenMetrics: true}))
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, req *http.Request) {
		ok, why := ready.Check(req.Context())
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = w.Write([]byte(why + "\n"))
	})
	return newServer(addr, mux)
}

// Server is an http.Server with the ops limits: every phase of a
// connection has a timeout, and its listener caps the open connections.
type Server struct {
	*http.Server
	limit *connLimiter
}

func newServer(addr string, h http.Handler) *Server {
	limit := newConnLimiter(opsMaxConns, opsHeadGrace)
	return &Server{limit: limit, Server: &http.Server{
		Addr:              addr,
		Handler:           h,
		ReadHeaderTimeout: opsReadHeaderTimeout,
		ReadTimeout:       opsReadTimeout,
		WriteTimeout:      opsWriteTimeout,
		IdleTimeout:       opsIdleTimeout,
		MaxHeaderBytes:    opsMaxHeaderBytes,
		ConnState:         limit.track,
	}}
}

// listen binds before anything else starts, so a taken port fails fast and
// /readyz can answer 503 while the worker is still starting.
func (s *Server) Listen() (net.Listener, error) {
	ln, err := net.Listen("tcp", s.Addr)
	if err != nil {
		return nil, err
	}
	return s.limit.listener(ln), nil
}
