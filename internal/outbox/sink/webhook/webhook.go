// Package webhook is the webhook sink (outbox.sink: webhook): each event is
// one POST of a CloudEvent in HTTP binary mode, signed per Standard
// Webhooks when a secret is configured. The wire convention is
// internal/broker/webhook's, which the inbox's webhook source reads.
package webhook

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/broker"
	webhookbroker "github.com/worker-dev/worker/internal/broker/webhook"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

const (
	// maxErrorBody bounds the response snippet quoted in errors, which end
	// up in logs and in outbox_event.last_error.
	maxErrorBody = 200
	// maxDrain bounds how much of a response is read to let the connection
	// be reused; a receiver that streams more is not worth waiting for.
	maxDrain = 64 << 10
	// maxRetryAfter caps a receiver's Retry-After: an absurd value must not
	// park an event for days, and seconds*time.Second must not overflow.
	maxRetryAfter = time.Hour
)

// Sink POSTs each event to one URL as a CloudEvent in HTTP binary
// mode, signed per Standard Webhooks when a secret is configured.
type Sink struct {
	template  *http.Request // POST to the URL, parsed once; each request is a copy
	auth      []string      // Authorization value from the URL's user info; nil if none
	shown     string        // url without password or query, for error messages
	key       []byte        // HMAC key; nil means unsigned
	secrets   []string
	timeout   time.Duration
	transport http.RoundTripper
	now       func() time.Time // replaced in tests to pin webhook-timestamp and Retry-After dates
}

// New validates cfg and returns the sink; a nil transport means
// newTransport. The sink hands each request to the transport
// directly, not through an http.Client: a transport never follows
// redirects (a redirected POST either loses its body or is sent somewhere
// nobody configured), and the client's per-request work (copying the
// headers for a redirect) would be wasted.
func New(cfg outboxconfig.WebhookConfig, transport http.RoundTripper) (*Sink, error) {
	u, err := parseURL(cfg.URL)
	if err != nil {
		return nil, err
	}
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("outbox.webhook.timeout (APP_OUTBOX_WEBHOOK_TIMEOUT) %s: want a positive duration such as 10s", cfg.Timeout)
	}
	key, err := webhookbroker.Key(cfg.Secret)
	if err != nil {
		return nil, fmt.Errorf("outbox.webhook.secret (APP_OUTBOX_WEBHOOK_SECRET): %w; drop the prefix to use the text itself as the key", err)
	}
	template, err := http.NewRequest(http.MethodPost, u.String(), nil)
	if err != nil {
		// Not wrapped: the cause quotes the URL with its credentials.
		return nil, fmt.Errorf("outbox.webhook.url (APP_OUTBOX_WEBHOOK_URL) %q: not usable for a request", shownURL(u))
	}
	if transport == nil {
		transport = newTransport()
	}
	s := &Sink{
		template:  template,
		shown:     shownURL(u),
		key:       key,
		timeout:   cfg.Timeout,
		transport: transport,
		now:       time.Now,
	}
	if u.User != nil {
		// What http.Client would add for user info in the URL.
		pass, _ := u.User.Password()
		s.auth = []string{"Basic " + base64.StdEncoding.EncodeToString([]byte(u.User.Username()+":"+pass))}
	}
	if key != nil {
		// Every form a receiver could echo back: as configured, its base64
		// part, and the key bytes themselves.
		s.secrets = []string{cfg.Secret, strings.TrimPrefix(cfg.Secret, webhookbroker.SecretPrefix), string(key)}
	}
	return s, nil
}

// idleConns is how many keep-alive connections the sink keeps to
// its receiver. It must cover the publishes in flight at once
// (outbox.max_in_flight, 64 by default): net/http keeps only 2 per host by
// default, so every request beyond that would open a new connection and
// leave one in TIME_WAIT. Connections are only opened when that many
// publishes overlap, and idle ones close after the transport's idle
// timeout.
const idleConns = 1024

// newTransport is http.DefaultTransport's configuration (proxy from
// the environment, dial and TLS timeouts, HTTP/2 over TLS) with enough idle
// connections. Compression is off: answers are not read beyond an error
// snippet, so asking for gzip would only add a header to every request.
func newTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns = idleConns
	t.MaxIdleConnsPerHost = idleConns
	t.DisableCompression = true
	return t
}

func parseURL(raw string) (*url.URL, error) {
	const key = "outbox.webhook.url (APP_OUTBOX_WEBHOOK_URL)"
	if raw == "" {
		return nil, fmt.Errorf("%s is empty: the webhook sink needs an absolute http:// or https:// URL", key)
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		// MaskDSN: the value may carry basic-auth credentials.
		return nil, fmt.Errorf("%s %q: want an absolute http:// or https:// URL, such as https://hooks.example.com/outbox", key, obs.MaskDSN(raw))
	}
	// url.Parse takes any digits as a port; a dial would fail on every
	// event instead of once, at start.
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("%s %q: port %s: want a port from 1 to 65535", key, shownURL(u), p)
		}
	}
	return u, nil
}

// shownURL is u as errors and logs may show it: receivers often put a
// token in the query string, or basic-auth credentials in the URL.
func shownURL(u *url.URL) string {
	c := *u
	c.User = nil
	if c.RawQuery != "" {
		c.RawQuery = "xxxxx"
	}
	c.Fragment = ""
	return c.String()
}

// Name implements outbox.Sink.
func (s *Sink) Name() string { return outboxconfig.SinkWebhook }

// String keeps the key out of anything that formats the sink.
func (s *Sink) String() string { return "webhook(" + s.shown + ")" }

// Publish implements outbox.Sink: one POST per event. A 2xx answer is success.
// A network error, a timeout and 408, 429, 502, 503 and 504 say the
// receiver is down or overloaded: Unavailable, so the event keeps its
// attempts while the relay waits for the receiver. A 500 or another 5xx is
// this event's failure (it counts toward max_attempts): the receiver
// answered and may take other events. Both carry the receiver's
// Retry-After when it gives one. Any other answer is permanent.
func (s *Sink) Publish(ctx context.Context, e outbox.Event) error {
	if e.EventID == "" || e.EventType == "" || e.AggregateType == "" {
		// ce-id, ce-type and ce-source are required CloudEvents attributes.
		return outbox.Permanent(fmt.Errorf("webhook: event seq %d lacks event_id, event_type or aggregate_type", e.Seq))
	}
	var ceTime string
	if !e.OccurredAt.IsZero() {
		t, err := outbox.RFC3339(e.OccurredAt)
		if err != nil {
			return fmt.Errorf("webhook: event %s: %w", e.EventID, err)
		}
		ceTime = t
	}
	body := []byte(e.Payload)
	if len(body) == 0 {
		body = []byte("null")
	}

	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	resp, err := s.transport.RoundTrip(s.request(ctx, s.headers(e, ceTime, body), body))
	if err != nil {
		// Refused, reset, DNS, TLS, timeout: the receiver may be back later.
		return outbox.Unavailable(fmt.Errorf("webhook: event %s: %w", e.EventID, &url.Error{Op: "Post", URL: s.shown, Err: err}))
	}
	defer func() {
		// Drain a little so the keep-alive connection can be reused. An
		// answer without a body (204, Content-Length: 0) is http.NoBody.
		if resp.Body != http.NoBody {
			_, _ = io.CopyN(io.Discard, resp.Body, maxDrain)
		}
		resp.Body.Close()
	}()

	code := resp.StatusCode
	if code >= 200 && code < 300 {
		return nil
	}
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	err = fmt.Errorf("webhook: event %s: POST %s: %s: %s", e.EventID, s.shown, resp.Status, s.mask(snippet))
	if d, ok := retryAfter(resp.Header.Get("Retry-After"), s.now()); ok && (broker.UnavailableStatus(code) || code >= 500) {
		err = &outbox.RetryAfterError{Err: err, After: d}
	}
	switch {
	case broker.UnavailableStatus(code):
		return outbox.Unavailable(err)
	case code >= 500:
		return err
	case code >= 300 && code < 400:
		return outbox.Permanent(fmt.Errorf("%w (redirect to %q is not followed; configure the final URL)", err, resp.Header.Get("Location")))
	default:
		return outbox.Permanent(err)
	}
}

// request is the POST of body with headers h, bounded by ctx: a copy of
// the template, so the URL is not parsed again. The body is an
// io.NopCloser over a bytes.Reader, which net/http recognises as in
// memory and writes with the headers in one system call.
func (s *Sink) request(ctx context.Context, h http.Header, body []byte) *http.Request {
	req := s.template.WithContext(ctx)
	req.Header = h
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	req.ContentLength = int64(len(body))
	return req
}

// Header values that are the same on every request, shared read-only by
// all of them.
var (
	jsonContentType = []string{"application/json"}
	webhookAgent    = []string{"worker-outbox"}
)

// headers builds the request headers for e; ceTime is its occurred_at in
// RFC 3339, or empty to leave ce-time out. Stored event headers go
// first, so the ones the protocol owns (ce-*, webhook-*, Content-Type)
// always overwrite them. Keys are written in canonical form directly, the
// constant values are shared and the others share one backing array: this
// runs once per event.
func (s *Sink) headers(e outbox.Event, ceTime string, body []byte) http.Header {
	// At most: the stored headers, Authorization, 2 constant, 6 ce-* and 3
	// webhook-* headers.
	h := make(http.Header, len(e.Headers)+12)
	vals := make([]string, 0, len(e.Headers)+9)
	set := func(k, v string) {
		vals = append(vals, v)
		h[k] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	for k, v := range e.Headers {
		if passThrough(k, v) {
			set(http.CanonicalHeaderKey(k), v)
		}
	}
	if s.auth != nil {
		h["Authorization"] = s.auth // passThrough dropped any stored one
	}
	h["Content-Type"] = jsonContentType
	h["User-Agent"] = webhookAgent
	webhookbroker.Encode(broker.Attributes{ID: e.EventID, Source: e.AggregateType, Type: e.EventType, Subject: e.AggregateID, Time: ceTime}, set)
	if s.key != nil {
		id, ts := e.EventID, strconv.FormatInt(s.now().Unix(), 10)
		set("Webhook-Id", id)
		set("Webhook-Timestamp", ts)
		set("Webhook-Signature", "v1,"+webhookbroker.Sign(s.key, id, ts, body))
	}
	return h
}

// passThrough reports whether a stored event header may be sent. It is
// false for the headers in droppedHeaders and for the ce-, webhook- and
// proxy- prefixes, and for a name or value HTTP cannot carry, which would
// fail every attempt and turn a good event DEAD. Such headers are dropped
// rather than refused: the same event may go to a broker sink that
// carries them as plain metadata, and the sink's own headers must win
// whatever a producer stored.
func passThrough(name, value string) bool {
	n := strings.ToLower(name)
	if strings.HasPrefix(n, "ce-") || strings.HasPrefix(n, "webhook-") || strings.HasPrefix(n, "proxy-") {
		return false
	}
	if _, dropped := droppedHeaders[n]; dropped {
		return false
	}
	return validHeaderName(name) && validHeaderValue(value)
}

// droppedHeaders are the stored event headers the webhook never sends (in
// lower case; docs/sinks.md lists them). Credentials: the receiver's
// credentials are the configured URL's, never a producer's. Hop-by-hop
// and framing headers (RFC 9110 7.6.1, Expect's 100-continue): they
// belong to one connection and would corrupt or stall the request.
// The sink's own: what the request and the CloudEvents binding set.
var droppedHeaders = map[string]struct{}{
	// credentials
	"authorization": {}, "cookie": {},
	// hop-by-hop and framing
	"connection": {}, "keep-alive": {}, "te": {}, "trailer": {}, "transfer-encoding": {},
	"upgrade": {}, "expect": {},
	// the sink's own
	"host": {}, "content-length": {}, "content-type": {}, "content-encoding": {}, "user-agent": {},
}

// validHeaderName reports whether s is an RFC 9110 token.
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' {
			continue
		}
		if !strings.ContainsRune("!#$%&'*+-.^_`|~", rune(c)) {
			return false
		}
	}
	return true
}

// validHeaderValue rejects control characters other than tab, as net/http
// does before sending.
func validHeaderValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// retryAfter parses a Retry-After value: delay-seconds or an HTTP date.
func retryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	var d time.Duration
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs < 0 {
			return 0, false
		}
		d = maxRetryAfter
		if secs < int64(maxRetryAfter/time.Second) {
			d = time.Duration(secs) * time.Second
		}
	} else if t, err := http.ParseTime(v); err == nil {
		d = max(t.Sub(now), 0)
	} else {
		return 0, false
	}
	return min(d, maxRetryAfter), true
}

// mask quotes a response snippet for an error message, without the secret
// (a receiver that knows it could echo it back) and without credentials a
// receiver echoes from the request or its own configuration: the snippet
// reaches last_error, the log and `outbox dead list`.
func (s *Sink) mask(b []byte) string {
	t := string(b)
	for _, sec := range s.secrets {
		if sec != "" {
			t = strings.ReplaceAll(t, sec, "xxxxx")
		}
	}
	return strconv.Quote(maskCredentials(t))
}

// Credentials as receivers echo them: an Authorization header's value
// (whatever its scheme), a bearer or basic token on its own, a parameter
// whose name says it is a credential (token=, access_token=, password=,
// client_secret=, api_key=, and the JSON "name": "value" form), and the
// user info of a URL.
var (
	authHeaderValue = regexp.MustCompile(`(?i)((?:proxy-)?authorization"?\s*[:=]\s*"?)[^"\r\n,;}]*`)
	schemeToken     = regexp.MustCompile(`(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]+`)
	credentialParam = regexp.MustCompile(`(?i)([\w.-]*(?:token|passw(?:or)?d|pwd|secret|api[_-]?key|apikey|signature|credential|session)[\w.-]*(?:"\s*:\s*"|=))[^"&\s,;}]*`)
	urlUserInfo     = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#@\s]+@`)
)

// maskCredentials replaces every credential maskCredentials recognises in
// t with xxxxx, keeping the name so the text still says what was there.
func maskCredentials(t string) string {
	t = authHeaderValue.ReplaceAllString(t, "${1}xxxxx")
	t = schemeToken.ReplaceAllString(t, "${1}${2}xxxxx")
	t = credentialParam.ReplaceAllString(t, "${1}xxxxx")
	return urlUserInfo.ReplaceAllString(t, "${1}xxxxx@")
}
