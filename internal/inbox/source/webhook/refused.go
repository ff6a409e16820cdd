package webhook

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/worker-dev/worker/internal/obs"
)

// Reasons a request is refused: the values of
// inbox_webhook_refused_total's reason label, and the "reason" of the
// answer's body.
const (
	reasonBadRequest   = "bad_request"        // 400: unreadable body, no dedupe key
	reasonBadSignature = "bad_signature"      // 401: missing, stale or wrong signature
	reasonNotFound     = "not_found"          // 404: another path
	reasonMethod       = "method_not_allowed" // 405: not a POST
	reasonSlowBody     = "slow_body"          // 408: the body came slower than the minimum rate
	reasonTooLarge     = "too_large"          // 413: a body over max_body
	reasonBusy         = "busy"               // 503: max_in_flight requests, or the body budget, taken
	reasonInProgress   = "in_progress"        // 503: the same message is being processed by another claim
	reasonUnavailable  = "unavailable"        // 503: the inbox's database failed
	reasonTimeout      = "timeout"            // 503: the work did not commit within the timeout
	reasonSlowHeader   = "slow_header"        // no answer: no request head within readHeaderTimeout
	reasonUnstorable   = "unstorable"         // 400: dead-lettered, its text cannot be stored (a NUL byte, not UTF-8)
	reasonRecovery     = "recovery_required"  // 409: an earlier delivery's work was cut off; an operator decides
)

var reasons = []string{
	reasonBadRequest, reasonBadSignature, reasonNotFound, reasonMethod, reasonSlowBody, reasonTooLarge,
	reasonBusy, reasonInProgress, reasonUnavailable, reasonTimeout, reasonSlowHeader, reasonUnstorable, reasonRecovery,
}

// refusedLogRate bounds the log lines about refused requests, per source:
// a flood of them (a sender with a wrong secret, an attack) writes one
// line a second after a burst, each saying how many it stands for.
const (
	refusedLogEvery = time.Second
	refusedLogBurst = 10
)

// refusals counts and logs the requests a source refuses.
type refusals struct {
	source  string
	counter *prometheus.CounterVec
	log     *slog.Logger
	limit   *rate.Limiter

	mu         sync.Mutex
	suppressed int // lines not written since the last one
	heads      map[net.Conn]time.Time
}

func newRefusals(source string, reg prometheus.Registerer, log *slog.Logger) (*refusals, error) {
	counter := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "inbox_webhook_refused_total",
		Help: "Requests a webhook source refused, by source and reason: bad_request, bad_signature, not_found, method_not_allowed, slow_body, too_large, busy, in_progress, unavailable, timeout, slow_header, unstorable, recovery_required.",
	}, []string{"source", "reason"})
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	counter, err := obs.Register(reg, counter)
	if err != nil {
		return nil, err
	}
	for _, r := range reasons {
		counter.WithLabelValues(source, r)
	}
	return &refusals{
		source: source, counter: counter, log: log,
		limit: rate.NewLimiter(rate.Every(refusedLogEvery), refusedLogBurst),
		heads: map[net.Conn]time.Time{},
	}, nil
}

// refuse counts one refusal and logs it, unless the log's rate is spent.
func (rf *refusals) refuse(remote, webhookID string, status int, reason, detail string) {
	rf.counter.WithLabelValues(rf.source, reason).Inc()
	rf.mu.Lock()
	if !rf.limit.Allow() {
		rf.suppressed++
		rf.mu.Unlock()
		return
	}
	suppressed := rf.suppressed
	rf.suppressed = 0
	rf.mu.Unlock()
	attrs := []any{"error.code", obs.CodeInboxWebhookRefused, "reason", reason, "status", status, "detail", detail, "remote_addr", remote}
	if webhookID != "" {
		attrs = append(attrs, "webhook_id", clip(webhookID))
	}
	if suppressed > 0 {
		attrs = append(attrs, "refusals_not_logged", suppressed)
	}
	rf.log.Warn("inbox webhook request refused", attrs...)
}

// connState is the server's ConnState hook: a connection that closes
// before any request of it reached a handler, having been open for
// readHeaderTimeout at least, was cut off by it (a sender trickling its
// head, or a connection opened and left). One closed sooner is a client
// that changed its mind.
func (rf *refusals) connState(c net.Conn, state http.ConnState) {
	rf.mu.Lock()
	opened, waiting := rf.heads[c]
	switch state {
	case http.StateNew:
		rf.heads[c] = time.Now()
	case http.StateHijacked, http.StateClosed:
		delete(rf.heads, c)
	}
	rf.mu.Unlock()
	if state == http.StateClosed && waiting && time.Since(opened) >= readHeaderTimeout {
		rf.refuse(c.RemoteAddr().String(), "", 0, reasonSlowHeader, "no request head within "+readHeaderTimeout.String()+"; the connection was closed")
	}
}

// connKey is the request context's key of its connection.
type connKey struct{}

// withConn is the server's ConnContext hook.
func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// headArrived marks r's connection as having sent a whole request head.
func (rf *refusals) headArrived(r *http.Request) {
	if c, ok := r.Context().Value(connKey{}).(net.Conn); ok {
		rf.mu.Lock()
		delete(rf.heads, c)
		rf.mu.Unlock()
	}
}

// clip shortens a header value for a log line.
func clip(s string) string {
	const n = 128
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
