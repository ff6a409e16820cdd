package startup

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

	"worker/internal/migrate"
)

// readiness decides /readyz: ready only when the database (and a broker
// sink's broker) answers, the migrations are current and the scheduler has
// started, and not while draining.
type readiness struct {
	started  atomic.Bool
	draining atomic.Bool
	pool     atomic.Pointer[pgxpool.Pool]
	// broker reports a broker sink's connection; set before started.
	broker func(context.Context) error

	mu       sync.Mutex
	migrated bool // sticky once seen current: migrations never go back
}

func (r *readiness) check(ctx context.Context) (bool, string) {
	switch {
	case r.draining.Load():
		return false, "draining"
	case !r.started.Load():
		return false, "starting"
	}
	pool := r.pool.Load()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := pool.Ping(ctx); err != nil {
		return false, "database unreachable"
	}
	if r.broker != nil {
		if err := r.broker(ctx); err != nil {
			return false, "broker unreachable: " + err.Error()
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.migrated {
		pending, err := migrate.Pending(ctx, pool)
		if err != nil || pending {
			return false, "migrations pending"
		}
		r.migrated = true
	}
	return true, "ok"
}

// newOpsServer serves metrics and probes, and River UI when ui is not nil.
func newOpsServer(addr string, reg *prometheus.Registry, ready *readiness, ui http.Handler) *http.Server {
	mux := http.NewServeMux()
	if ui != nil {
		mux.Handle(uiPrefix+"/", ui)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, req *http.Request) {
		ok, why := ready.check(req.Context())
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = w.Write([]byte(why + "\n"))
	})
	return &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
}

// listen binds before anything else starts, so a taken port fails fast and
// /readyz can answer 503 while the worker is still starting.
func listen(srv *http.Server) (net.Listener, error) { return net.Listen("tcp", srv.Addr) }
