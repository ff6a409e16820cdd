package startup

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"log/slog"
	"net/http"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
	"riverqueue.com/riverui"

	"worker/internal/tasks"
)

// UIConfig is the `ui:` section: River UI on the ops server.
type UIConfig struct {
	Enabled  bool   `koanf:"enabled"`
	Username string `koanf:"username"`
	Password string `koanf:"password" secret:"password"`
}

// uiPrefix is where River UI is served. /metrics, /livez and /readyz stay
// outside it and open: Prometheus and probes do not authenticate.
const uiPrefix = "/riverui"

// uiMount is River UI behind basic auth, mounted on the ops server before
// the database is connected; until then it answers 503 (after auth).
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

// basicAuth admits requests carrying the configured user name and password.
// Both are compared in constant time, through their hashes so that even
// their lengths do not leak.
func basicAuth(username, password string, next http.Handler) http.Handler {
	wantUser, wantPass := sha256.Sum256([]byte(username)), sha256.Sum256([]byte(password))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		gotUser, gotPass := sha256.Sum256([]byte(u)), sha256.Sum256([]byte(p))
		userOK := subtle.ConstantTimeCompare(gotUser[:], wantUser[:])
		passOK := subtle.ConstantTimeCompare(gotPass[:], wantPass[:])
		if !ok || userOK&passOK != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="worker River UI", charset="UTF-8"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}
