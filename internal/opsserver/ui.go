package opsserver

import (
	"log/slog"
	"net/http"

	"github.com/worker-dev/worker/internal/config"
)

// UIPrefix is where River UI is served. /metrics, /livez and /readyz stay
// outside it and open: Prometheus and probes do not authenticate.
const UIPrefix = "/riverui"

// GuardUI is everything between the network and River UI, outermost
// first: failed logins slowed per client address, basic auth, an audit
// line per action, cross-site writes refused, API writes in JSON.
func GuardUI(cfg config.UIConfig, ui http.Handler, log *slog.Logger) http.Handler {
	log = log.With("component", "riverui")
	h := requireJSONWrites(ui)
	h = http.NewCrossOriginProtection().Handler(h)
	h = auditActions(h, log)
	return newLoginGuard(cfg.Username, cfg.Password, log).wrap(h)
}

// NewUI is the UI's own server, on ui.addr, with the ops server's
// limits.
func NewUI(addr string, ui http.Handler) *Server {
	mux := http.NewServeMux()
	mux.Handle(UIPrefix+"/", ui)
	return newServer(addr, mux)
}
