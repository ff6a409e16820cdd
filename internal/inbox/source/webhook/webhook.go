// Package webhook is the HTTP inbox source (inbox.sources[].kind:
// webhook): a server of its own that takes Standard Webhooks POSTs
// (https://www.standardwebhooks.com), such as the outbox's webhook sink
// sends, each request a batch of one. The answer says what the inbox
// committed, so a sender retries exactly what it must (docs/inbox.md,
// "Webhook answers", has the full table):
//
//	200 processed: the work committed now
//	200 or 409 (duplicate_status) duplicate: the work had committed before
//	200 dead: dead-lettered in the inbox (out of attempts, or a permanent
//	    failure), now or before; an operator takes it from there (worker
//	    inbox dead), and a resend would only be a duplicate
//	400 dead: a ce-id, ce-source, ce-subject, ce-type or header the
//	    database cannot store (a NUL byte, or not UTF-8): dead-lettered
//	    with its reason, escaped; a resend is answered alike
//	400 the body could not be read, or the message has no dedupe key:
//	    nothing was stored
//	409 recovery_required: an earlier delivery's work was cut off before
//	    it committed, by a handler with external effects; an operator
//	    decides (worker inbox recovery), and a resend after that is
//	    answered as a duplicate
//	401 a missing, stale or wrong signature: nothing was stored
//	404 another path; 405 not a POST
//	408 the body came slower than the minimum rate
//	413 a body over max_body
//	503 with Retry-After, and a reason in the body: busy (the receiver is
//	    full), in_progress (the same message is being processed by
//	    another request or replica), unavailable (the database failed),
//	    timeout (the work did not commit within the source's timeout)
//
// The body of every answer is a JSON object naming the outcome, or the
// error and its reason. A 2xx comes only after the commit. Every refusal
// is counted (inbox_webhook_refused_total{source,reason}) and logged at a
// bounded rate with error.code=INBOX_WEBHOOK_REFUSED.
//
// Slow senders. A request takes one of max_in_flight slots only once its
// body has arrived: the body is read under a deadline that its progress
// earns (bodyGrace, then minBodyRate), and the head under
// readHeaderTimeout. The bytes of the bodies held at once are bounded by
// max_in_flight × max_body, taken as they arrive; the connections by
// DefaultMaxConns.
//
// Dedupe key: the CloudEvents ce-source and ce-id when the request has
// ce-id; else the source's configured key (header:<name> or
// field:<name>); else the webhook-id, the Standard Webhooks message id a
// sender keeps across its retries.
package webhook

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/netutil"

	"github.com/worker-dev/worker/internal/broker"
	webhookbroker "github.com/worker-dev/worker/internal/broker/webhook"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
)

// Server limits. A request is a small head and a body of at most
// max_body (see body.go for how long the body may take); the slowest part
// is the inbox's work, bounded by the source's timeout.
const (
	readHeaderTimeout = 5 * time.Second
	idleTimeout       = 60 * time.Second
	maxHeaderBytes    = 32 << 10
	// answerTime bounds writing an answer, past the work's timeout.
	answerTime = 5 * time.Second
	// DefaultMaxInFlight bounds the requests in the inbox at once, each
	// with its body read and holding database connections; past it a
	// request is answered 503 at once.
	DefaultMaxInFlight = 64
	// DefaultMaxConns bounds open connections: each costs a goroutine and
	// its buffers even while idle. Past it, new connections wait in the
	// kernel's backlog until one closes.
	DefaultMaxConns = 1024
	// shutdownGrace is how long requests in flight may finish at shutdown
	// before their work is cancelled (they answer 503, and the sender
	// retries).
	shutdownGrace = 10 * time.Second
)

// Options are what the source needs beside its configuration section.
type Options struct {
	// Name is the inbox source's name, for errors, logs and metrics.
	Name string
	// Key is the source's configured dedupe key (inbox.sources[].key),
	// used for a request without ce-id in place of its webhook-id.
	Key string
	// MaxInFlight and MaxConns override DefaultMaxInFlight and
	// DefaultMaxConns when positive.
	MaxInFlight int
	MaxConns    int
	// Logger receives the refused requests and the server's own errors
	// (a failed TLS handshake, a broken connection); nil discards them.
	Logger *slog.Logger
	// Registerer takes inbox_webhook_refused_total; nil keeps it private.
	Registerer prometheus.Registerer
}

// Source serves one path. Run may be called once at a time.
type Source struct {
	cfg      inboxconfig.WebhookSource
	section  string
	keys     [][]byte // HMAC keys
	dedupe   inboxconfig.KeySpec
	slots    chan struct{}
	bodies   *budget
	maxConns int
	log      *slog.Logger
	refused  *refusals
	now      func() time.Time
	// bodyGrace and minBodyRate are the constants, but for tests.
	bodyGrace   time.Duration
	minBodyRate int

	mu   sync.Mutex
	addr string // once listening
}

var _ inbox.Source = (*Source)(nil)

// New checks cfg and returns a source that is not listening yet.
func New(cfg inboxconfig.WebhookSource, opts Options) (*Source, error) {
	inFlight := cmp.Or(max(opts.MaxInFlight, 0), DefaultMaxInFlight)
	s := &Source{
		cfg:         cfg,
		section:     fmt.Sprintf("inbox.sources[%s].webhook", opts.Name),
		slots:       make(chan struct{}, inFlight),
		bodies:      newBudget(int64(inFlight) * max(cfg.MaxBody, 1)),
		maxConns:    cmp.Or(max(opts.MaxConns, 0), DefaultMaxConns),
		log:         opts.Logger,
		now:         time.Now,
		bodyGrace:   bodyGrace,
		minBodyRate: minBodyRate,
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	switch {
	case cfg.Addr == "":
		return nil, fmt.Errorf("%s.addr is empty: want host:port to listen on, such as :8081", s.section)
	case !strings.HasPrefix(cfg.Path, "/") || strings.ContainsAny(cfg.Path, "{} \t"):
		return nil, fmt.Errorf("%s.path=%q: want an absolute path without braces or spaces, such as /inbox", s.section, cfg.Path)
	case cfg.Tolerance <= 0:
		return nil, fmt.Errorf("%s.tolerance=%s: want a positive duration such as 5m", s.section, cfg.Tolerance)
	case cfg.MaxBody < 1:
		return nil, fmt.Errorf("%s.max_body=%d: want a positive number of bytes", s.section, cfg.MaxBody)
	case cfg.DuplicateStatus != http.StatusOK && cfg.DuplicateStatus != http.StatusConflict:
		return nil, fmt.Errorf("%s.duplicate_status=%d: want 200 (the sender stops) or 409", s.section, cfg.DuplicateStatus)
	case cfg.Timeout <= 0:
		return nil, fmt.Errorf("%s.timeout=%s: want a positive duration such as 30s", s.section, cfg.Timeout)
	}
	var err error
	if s.keys, err = parseSecrets(cfg.Secret); err != nil {
		return nil, fmt.Errorf("%s.secret: %w", s.section, err)
	}
	if s.dedupe, err = inboxconfig.ParseKey(opts.Key); err != nil {
		return nil, fmt.Errorf("inbox.sources[%s].key: %w", opts.Name, err)
	}
	if s.refused, err = newRefusals(opts.Name, opts.Registerer, s.log); err != nil {
		return nil, err
	}
	return s, nil
}

// parseSecrets returns the HMAC keys of a space-separated list of secrets
// (several while one is rotated). A whsec_ secret is base64, as Standard
// Webhooks issues them; any other is used as raw bytes, as the outbox's
// webhook sink does. Errors never quote the value.
func parseSecrets(list string) ([][]byte, error) {
	var keys [][]byte
	for _, secret := range strings.Fields(list) {
		key, err := webhookbroker.Key(secret)
		if err != nil {
			return nil, err
		}
		keys = append(keys, key)
	}
	if len(keys) == 0 {
		// Unsigned requests would let anyone who reaches the port put work
		// into the database.
		return nil, errors.New("empty: the receiver verifies every request's webhook-signature; give the secret the sender signs with")
	}
	return keys, nil
}

// Addr is the address the source listens on, "" until it does.
func (s *Source) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Run implements inbox.Source: it listens, reports h.Up, and serves until
// ctx ends, then shuts the server down, giving requests in flight
// shutdownGrace to finish. A listen error (an address in use, a port
// refused) wraps broker.ErrSetup.
func (s *Source) Run(ctx context.Context, h inbox.Handoff) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("%w: %s.addr=%q: %w", broker.ErrSetup, s.section, s.cfg.Addr, err)
	}
	s.mu.Lock()
	s.addr = ln.Addr().String()
	s.mu.Unlock()

	// Requests' contexts end when their grace at shutdown does, not when
	// ctx does: Shutdown lets them finish first.
	base, cancelRequests := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRequests()
	pattern := "POST " + s.cfg.Path
	if strings.HasSuffix(pattern, "/") {
		pattern += "{$}" // the path itself, not the tree below it
	}
	mux := http.NewServeMux()
	mux.Handle(pattern, &handler{s: s, h: h})
	mux.HandleFunc("/", s.elsewhere)
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.refused.headArrived(r)
			mux.ServeHTTP(w, r)
		}),
		ReadHeaderTimeout: readHeaderTimeout,
		// No ReadTimeout: the handler reads the body under the deadline
		// its progress earns (readBody).
		// From the end of the head: the slowest body allowed, the inbox's
		// work, the answer.
		WriteTimeout:   s.bodyGrace + time.Duration(float64(s.cfg.MaxBody)/float64(s.minBodyRate)*float64(time.Second)) + s.cfg.Timeout + answerTime,
		IdleTimeout:    idleTimeout,
		MaxHeaderBytes: maxHeaderBytes,
		ConnState:      s.refused.connState,
		ConnContext:    withConn,
		BaseContext:    func(net.Listener) context.Context { return base },
		ErrorLog:       slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(netutil.LimitListener(ln, s.maxConns)) }()
	h.Up()

	select {
	case err := <-served:
		// Serve retries temporary accept errors itself; this one is not.
		h.Down(err)
		return fmt.Errorf("%s: serving on %s: %w", s.section, s.cfg.Addr, err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if srv.Shutdown(sctx) != nil {
		// Out of grace: end their work, which rolls back, and give them a
		// moment to answer 503 before the connections close.
		cancelRequests()
		last, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if srv.Shutdown(last) != nil {
			_ = srv.Close()
		}
	}
	<-served
	return nil
}
