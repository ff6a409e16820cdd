package startup

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
	"riverqueue.com/riverui"

	"github.com/worker-dev/worker/internal/opsserver"
	"github.com/worker-dev/worker/internal/tasks"
)

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
	h, err := tasks.NewUI(pool, opsserver.UIPrefix, log.With("component", "riverui"))
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
