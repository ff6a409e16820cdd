package startup

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
	"riverqueue.com/riverui"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/tasks"
)

// uiPrefix is where River UI is served. /metrics, /livez and /readyz stay
// outside it and open: Prometheus and probes do not authenticate.
const uiPrefix = "/riverui"

// uiMount is River UI, mounted before the database is connected; until
// then it answers 503 (after auth).
type uiMount struct {
	handler atomic.Pointer[riverui.Handler]
	cancel  context.CancelFunc
}

func (u *uiMount) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := u.handler.Load()
	if h == nil {
		http.Error(w, "starting", http.StatusServiceUnavailable)
		return
	}
	h.ServeHTTP(w, r)
}

// attach builds River UI on pool. It is a component: Start starts the UI's
// background queries, Shutdown stops them.
func (u *uiMount) attach(pool *pgxpool.Pool, log *slog.Logger) (component, error) {
	h, err := tasks.NewUI(pool, uiPrefix, log.With("component", "riverui"))
	if err != nil {
		return nil, err
	}
	u.handler.Store(h)
	return u, nil
}

func (u *uiMount) Start(ctx context.Context) error {
	ctx, u.cancel = context.WithCancel(ctx)
	return u.handler.Load().Start(ctx)
}

func (u *uiMount) Shutdown(context.Context) error {
	if u.cancel != nil {
		u.cancel()
	}
	return nil
}

// guardUI is everything between the network and River UI, outermost
// first: failed logins slowed per client address, basic auth, an audit
// line per action, cross-site writes refused, API writes in JSON.
func guardUI(cfg config.UIConfig, ui http.Handler, log *slog.Logger) http.Handler {
	log = log.With("component", "riverui")
	h := requireJSONWrites(ui)
	h = http.NewCrossOriginProtection().Handler(h)
	h = auditActions(h, log)
	return newLoginGuard(cfg.Username, cfg.Password, log).wrap(h)
}

// newUIServer is the UI's own server, on ui.addr, with the ops server's
// limits.
func newUIServer(addr string, ui http.Handler) *boundedServer {
	mux := http.NewServeMux()
	mux.Handle(uiPrefix+"/", ui)
	return newBoundedServer(addr, mux)
}
