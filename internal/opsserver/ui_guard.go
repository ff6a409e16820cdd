package opsserver

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"io"
	"log/slog"
	"math"
	"mime"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Failed logins: an address may get loginBurst wrong in a row, then one
// more every loginEvery. Enough for a person who mistypes; a guesser gets
// 3,600 tries an hour instead of thousands a second.
const (
	loginBurst = 10
	loginEvery = time.Second
	// loginAddrsMax bounds the addresses remembered. Beyond it, new
	// addresses share one limiter: a guesser spread over many addresses
	// is slowed as one.
	loginAddrsMax = 10_000
	// failureLogEvery spaces the WARN lines about failed logins; each line
	// counts the failures since the last one.
	failureLogEvery = 10 * time.Second
)

// loginGuard checks basic-auth credentials and slows guessing. Requests
// without credentials are answered 401 without counting: that is the
// browser asking for the login dialog, not a guess.
type loginGuard struct {
	wantUser, wantPass [sha256.Size]byte
	log                *slog.Logger

	// mu is held across the check and the count, so concurrent guesses
	// from one address cannot all pass the same last token.
	mu       sync.Mutex
	byAddr   map[string]*rate.Limiter
	overflow *rate.Limiter

	logMu    sync.Mutex
	loggedAt time.Time
	unlogged int
}

func newLoginGuard(username, password string, log *slog.Logger) *loginGuard {
	return &loginGuard{
		wantUser: sha256.Sum256([]byte(username)),
		wantPass: sha256.Sum256([]byte(password)),
		log:      log,
		byAddr:   make(map[string]*rate.Limiter),
		overflow: newLoginLimiter(),
	}
}

func newLoginLimiter() *rate.Limiter { return rate.NewLimiter(rate.Every(loginEvery), loginBurst) }

func (g *loginGuard) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		if !ok {
			challenge(w)
			return
		}
		addr := clientAddr(r.RemoteAddr)
		admitted, retryAfter := g.attempt(addr, user, pass)
		switch {
		case admitted:
			next.ServeHTTP(w, r)
		case retryAfter > 0:
			g.logFailure(addr, "rate_limited")
			w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
			http.Error(w, "too many failed logins from your address; retry later", http.StatusTooManyRequests)
		default:
			g.logFailure(addr, "wrong_credentials")
			challenge(w)
		}
	})
}

// attempt checks the credentials unless addr has used up its failures;
// then it answers how many seconds until the next check.
func (g *loginGuard) attempt(addr, user, pass string) (admitted bool, retryAfter int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	lim := g.limiter(addr)
	if tokens := lim.Tokens(); tokens < 1 {
		return false, int(math.Ceil((1 - tokens) * loginEvery.Seconds()))
	}
	// Both compared in constant time, through their hashes so that even
	// their lengths do not leak.
	gotUser, gotPass := sha256.Sum256([]byte(user)), sha256.Sum256([]byte(pass))
	userOK := subtle.ConstantTimeCompare(gotUser[:], g.wantUser[:])
	passOK := subtle.ConstantTimeCompare(gotPass[:], g.wantPass[:])
	if userOK&passOK == 1 {
		return true, 0
	}
	lim.Allow() // count the failure
	return false, 0
}

// limiter is addr's failure limiter. Addresses whose limiter is full again
// carry nothing worth keeping and are forgotten first.
func (g *loginGuard) limiter(addr string) *rate.Limiter {
	if lim, ok := g.byAddr[addr]; ok {
		return lim
	}
	if len(g.byAddr) >= loginAddrsMax {
		for a, lim := range g.byAddr {
			if lim.Tokens() >= loginBurst {
				delete(g.byAddr, a)
			}
		}
		if len(g.byAddr) >= loginAddrsMax {
			return g.overflow
		}
	}
	lim := newLoginLimiter()
	g.byAddr[addr] = lim
	return lim
}

// logFailure writes at most one line per failureLogEvery, counting the
// failures it stands for.
func (g *loginGuard) logFailure(addr, outcome string) {
	g.logMu.Lock()
	g.unlogged++
	if time.Since(g.loggedAt) < failureLogEvery {
		g.logMu.Unlock()
		return
	}
	n := g.unlogged
	g.unlogged, g.loggedAt = 0, time.Now()
	g.logMu.Unlock()
	g.log.Warn("river UI login failed", "remote_addr", addr, "outcome", outcome,
		"failures", n, "failures_window", failureLogEvery.String())
}

func challenge(w http.ResponseWriter) {
	w.Header().Set("WWW-Authenticate", `Basic realm="worker River UI", charset="UTF-8"`)
	http.Error(w, "unauthorized", http.StatusUnauthorized)
}

// clientAddr is the address failures are counted against: the peer's IP
// (a proxy in front of the UI makes all clients one), and for IPv6 its
// /64, which one host usually holds whole.
func clientAddr(remoteAddr string) string {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	if ip = ip.Unmap(); ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}

// safeMethod reports the methods that change nothing.
func safeMethod(m string) bool {
	return m == http.MethodGet || m == http.MethodHead || m == http.MethodOptions
}

// requireJSONWrites refuses an API write without a JSON body type (415),
// unless the browser itself vouched that it came from the UI's own page
// (Sec-Fetch-Site: same-origin, a header no page can set). A form on
// another site can only send form or text types; River UI's own page
// posts its JSON as text/plain, so the browser's word is what admits it.
func requireJSONWrites(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if safeMethod(r.Method) || !strings.HasPrefix(r.URL.Path, UIPrefix+"/api/") ||
			r.Header.Get("Sec-Fetch-Site") == "same-origin" {
			next.ServeHTTP(w, r)
			return
		}
		if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
			http.Error(w, "API writes need Content-Type: application/json", http.StatusUnsupportedMediaType)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// auditBodyMax bounds the body read for the audit line: the UI's largest
// request names 1,000 task ids.
const auditBodyMax = 64 << 10

// auditActions logs one INFO line per UI action (every method but GET,
// HEAD and OPTIONS), in the shape of the CLI's: who, from where, what, on
// which tasks, and how it ended. Refused attempts are logged too.
func auditActions(next http.Handler, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if safeMethod(r.Method) {
			next.ServeHTTP(w, r)
			return
		}
		ids := readTaskIDs(w, r)
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(rec, r)
		user, _, _ := r.BasicAuth()
		outcome := "ok"
		if rec.status >= 400 {
			outcome = "refused"
			if rec.status >= 500 {
				outcome = "failed"
			}
		}
		log.Info("river UI action", "operator", user, "remote_addr", r.RemoteAddr,
			"action", uiAction(r), "task_ids", ids, "outcome", outcome, "status", rec.status)
	})
}

// uiAction names a write by its API path: "jobs/retry", "jobs/cancel",
// "jobs/delete", "queues/<name>/pause", and so on; PATCH on a queue is
// "queues/<name>/update".
func uiAction(r *http.Request) string {
	a := strings.TrimPrefix(r.URL.Path, UIPrefix+"/api/")
	if r.Method == http.MethodPatch {
		a += "/update"
	}
	return a
}

// readTaskIDs reads the "ids" of a jobs action and puts the body back for
// the UI.
func readTaskIDs(w http.ResponseWriter, r *http.Request) []string {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, auditBodyMax))
	r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), errReader{err}))
	var req struct {
		IDs []json.Number `json:"ids"`
	}
	if err != nil || json.Unmarshal(body, &req) != nil {
		return nil
	}
	ids := make([]string, len(req.IDs))
	for i, id := range req.IDs {
		ids[i] = id.String()
	}
	return ids
}

// errReader hands a body's read error (too large, cut off) on to the UI.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) {
	if e.err == nil {
		return 0, io.EOF
	}
	return 0, e.err
}

// statusRecorder remembers the status the UI answered.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.status = code
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }
