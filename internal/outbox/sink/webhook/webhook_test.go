package webhook

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// whRequest is what the test receiver saw.
type whRequest struct {
	Method string
	Path   string
	Header http.Header
	Body   []byte
}

// whReceiver is an httptest server that records every request and answers
// with reply.
type whReceiver struct {
	*httptest.Server
	mu   sync.Mutex
	reqs []whRequest
}

func newWHReceiver(t *testing.T, reply http.HandlerFunc) *whReceiver {
	t.Helper()
	r := &whReceiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		if err != nil {
			t.Errorf("receiver: read body: %v", err)
		}
		r.mu.Lock()
		r.reqs = append(r.reqs, whRequest{req.Method, req.URL.Path, req.Header.Clone(), body})
		r.mu.Unlock()
		if reply != nil {
			reply(w, req)
		} else {
			w.WriteHeader(http.StatusNoContent)
		}
	}))
	t.Cleanup(r.Close)
	return r
}

func (r *whReceiver) requests() []whRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]whRequest(nil), r.reqs...)
}

func (r *whReceiver) only(t *testing.T) whRequest {
	t.Helper()
	reqs := r.requests()
	if len(reqs) != 1 {
		t.Fatalf("receiver got %d requests, want 1", len(reqs))
	}
	return reqs[0]
}

func newTestWebhookSink(t *testing.T, url, secret string) *Sink {
	t.Helper()
	s, err := New(outboxconfig.WebhookConfig{URL: url, Secret: secret, Timeout: 5 * time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func whEvent() outbox.Event {
	return outbox.Event{
		Seq:           42,
		EventID:       "0b6a3c5e-2f4d-4e61-9d9a-7c1c2f0e8b11",
		AggregateType: "order",
		AggregateID:   "order-1001",
		EventType:     "order.shipped",
		Payload:       json.RawMessage(`{"order_id": 1001, "carrier": "DHL", "lines": [{"sku": "A-1", "qty": 2}]}`),
		Headers:       map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		OccurredAt:    time.Date(2024, 5, 6, 7, 8, 9, 123456000, time.FixedZone("CEST", 2*3600)),
	}
}

func TestWebhookSinkCloudEventsBinaryMode(t *testing.T) {
	rcv := newWHReceiver(t, nil)
	s := newTestWebhookSink(t, rcv.URL+"/hooks/outbox", "")
	if s.Name() != "webhook" {
		t.Fatalf("Name() = %q", s.Name())
	}
	e := whEvent()
	if err := s.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}

	got := rcv.only(t)
	if got.Method != http.MethodPost || got.Path != "/hooks/outbox" {
		t.Errorf("request = %s %s, want POST /hooks/outbox", got.Method, got.Path)
	}
	if string(got.Body) != string(e.Payload) {
		t.Errorf("body = %s, want the payload byte for byte: %s", got.Body, e.Payload)
	}
	want := map[string]string{
		"Content-Type":   "application/json",
		"User-Agent":     "worker-outbox",
		"Ce-Specversion": "1.0",
		"Ce-Id":          "0b6a3c5e-2f4d-4e61-9d9a-7c1c2f0e8b11",
		"Ce-Type":        "order.shipped",
		"Ce-Source":      "order",
		"Ce-Subject":     "order-1001",
		"Ce-Time":        "2024-05-06T05:08:09.123456Z",
		"Traceparent":    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	}
	for k, v := range want {
		if vals := got.Header.Values(k); len(vals) != 1 || vals[0] != v {
			t.Errorf("%s = %q, want exactly [%q]", k, vals, v)
		}
	}
	if _, err := time.Parse(time.RFC3339, got.Header.Get("Ce-Time")); err != nil {
		t.Errorf("ce-time is not RFC 3339: %v", err)
	}
	if got.Header.Get("Ce-Datacontenttype") != "" {
		t.Error("binary mode carries datacontenttype in Content-Type only")
	}
	for _, k := range []string{"Webhook-Id", "Webhook-Timestamp", "Webhook-Signature"} {
		if got.Header.Get(k) != "" {
			t.Errorf("%s sent without a secret", k)
		}
	}
}

func TestWebhookSinkPercentEncodesAttributes(t *testing.T) {
	rcv := newWHReceiver(t, nil)
	s := newTestWebhookSink(t, rcv.URL, "")
	e := whEvent()
	e.AggregateID = "Euro € 😀" // the example of the CloudEvents HTTP binding, 3.1.3.2
	e.AggregateType = `100% "quoted"`
	if err := s.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	got := rcv.only(t)
	if v := got.Header.Get("Ce-Subject"); v != "Euro%20%E2%82%AC%20%F0%9F%98%80" {
		t.Errorf("ce-subject = %q", v)
	}
	if v := got.Header.Get("Ce-Source"); v != "100%25%20%22quoted%22" {
		t.Errorf("ce-source = %q", v)
	}
}

// verifyStandardWebhook is the consumer's check, written from the spec
// alone: HMAC-SHA256(key, id "." timestamp "." body), base64, prefixed "v1,".
func verifyStandardWebhook(key []byte, h http.Header, body []byte) bool {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(h.Get("Webhook-Id") + "." + h.Get("Webhook-Timestamp") + "."))
	mac.Write(body)
	want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
	for _, sig := range strings.Fields(h.Get("Webhook-Signature")) {
		if hmac.Equal([]byte(sig), []byte(want)) {
			return true
		}
	}
	return false
}

func TestWebhookSinkSignature(t *testing.T) {
	keyBytes := []byte("0123456789abcdef0123456789abcdef") // 32 bytes, as providers issue them
	whsec := "whsec_" + base64.StdEncoding.EncodeToString(keyBytes)
	cases := []struct {
		name, secret string
		key          []byte // what a consumer derives from the secret
		notKey       []byte // the other reading, which must NOT verify
	}{
		{"whsec secret is base64 of the key", whsec, keyBytes, []byte(whsec)},
		{"other secret is the key itself", "plain-shared-secret", []byte("plain-shared-secret"), nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rcv := newWHReceiver(t, nil)
			s := newTestWebhookSink(t, rcv.URL, tc.secret)
			sentAt := time.Unix(1_715_000_000, 0)
			s.now = func() time.Time { return sentAt }
			e := whEvent()
			if err := s.Publish(context.Background(), e); err != nil {
				t.Fatal(err)
			}
			got := rcv.only(t)
			if v := got.Header.Get("Webhook-Id"); v != e.EventID {
				t.Errorf("webhook-id = %q, want the event_id %q", v, e.EventID)
			}
			if v := got.Header.Get("Webhook-Timestamp"); v != "1715000000" {
				t.Errorf("webhook-timestamp = %q, want unix seconds 1715000000", v)
			}
			if !strings.HasPrefix(got.Header.Get("Webhook-Signature"), "v1,") {
				t.Errorf("webhook-signature = %q, want v1,<base64>", got.Header.Get("Webhook-Signature"))
			}
			if !verifyStandardWebhook(tc.key, got.Header, got.Body) {
				t.Errorf("signature %q does not verify", got.Header.Get("Webhook-Signature"))
			}
			if tc.notKey != nil && verifyStandardWebhook(tc.notKey, got.Header, got.Body) {
				t.Error("signature verifies with the undecoded secret; whsec_ must be base64-decoded")
			}
			tampered := append([]byte(nil), got.Body...)
			tampered[len(tampered)-2] ^= 1
			if verifyStandardWebhook(tc.key, got.Header, tampered) {
				t.Error("signature verifies a tampered body")
			}
		})
	}
}

func TestWebhookSinkEventHeadersCannotOverrideProtocolHeaders(t *testing.T) {
	secret := "whsec_" + base64.StdEncoding.EncodeToString([]byte("override-test-key-0123456789"))
	rcv := newWHReceiver(t, nil)
	s := newTestWebhookSink(t, rcv.URL, secret)
	e := whEvent()
	e.Headers = map[string]string{
		"traceparent":       "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"tracestate":        "congo=t61rcWkgMzE",
		"CE-ID":             "forged",
		"ce-source":         "forged",
		"Content-Type":      "text/plain",
		"webhook-signature": "v1,forged",
		"WEBHOOK-ID":        "forged",
		"Content-Length":    "1",
		"Host":              "evil.example",
		"bad name":          "dropped",
		"x-injected":        "a\r\nX-Evil: 1",
	}
	if err := s.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	got := rcv.only(t)
	for k, v := range map[string]string{
		"Traceparent":  "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"Tracestate":   "congo=t61rcWkgMzE",
		"Ce-Id":        e.EventID,
		"Ce-Source":    "order",
		"Content-Type": "application/json",
		"Webhook-Id":   e.EventID,
	} {
		if vals := got.Header.Values(k); len(vals) != 1 || vals[0] != v {
			t.Errorf("%s = %q, want exactly [%q]", k, vals, v)
		}
	}
	key, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if !verifyStandardWebhook(key, got.Header, got.Body) {
		t.Errorf("signature overridden: %q", got.Header.Values("Webhook-Signature"))
	}
	if got.Header.Get("X-Injected") != "" || got.Header.Get("X-Evil") != "" {
		t.Error("a header value with CR/LF must be dropped")
	}
	if string(got.Body) != string(e.Payload) {
		t.Errorf("body = %s", got.Body)
	}
}

func TestWebhookSinkStatusClassification(t *testing.T) {
	now := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	cases := []struct {
		status     int
		retryAfter string
		want       string        // ok | unavailable | transient | permanent
		after      time.Duration // for transient with a usable Retry-After; -1 = none
	}{
		{200, "", "ok", -1},
		{201, "", "ok", -1},
		{202, "", "ok", -1},
		{204, "", "ok", -1},
		{408, "", "unavailable", -1},
		{429, "", "unavailable", -1},
		{500, "", "transient", -1},
		{501, "", "transient", -1},
		{502, "", "unavailable", -1},
		{503, "", "unavailable", -1},
		{504, "", "unavailable", -1},
		{505, "", "transient", -1},
		{429, "7", "unavailable", 7 * time.Second},
		{503, "0", "unavailable", 0},
		{408, "30", "unavailable", 30 * time.Second},
		{500, "15", "transient", 15 * time.Second},
		{503, now.Add(120 * time.Second).Format(http.TimeFormat), "unavailable", 120 * time.Second},
		{429, now.Add(-time.Minute).Format(http.TimeFormat), "unavailable", 0},              // date in the past: retry now
		{500, now.Add(90 * time.Second).Format(time.RFC850), "transient", 90 * time.Second}, // obsolete date form
		{503, "99999999999", "unavailable", time.Hour},                                      // capped
		{503, "soon", "unavailable", -1},                                                    // unparseable: plain backoff
		{503, "-5", "unavailable", -1},                                                      // negative: plain backoff
		{400, "", "permanent", -1},
		{401, "", "permanent", -1},
		{403, "", "permanent", -1},
		{404, "", "permanent", -1},
		{409, "", "permanent", -1},
		{410, "", "permanent", -1},
		{422, "", "permanent", -1},
		{400, "10", "permanent", -1}, // Retry-After does not make a 4xx retryable
		{301, "", "permanent", -1},
		{307, "", "permanent", -1},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%d_%s", tc.status, tc.retryAfter), func(t *testing.T) {
			rcv := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
				if tc.retryAfter != "" {
					w.Header().Set("Retry-After", tc.retryAfter)
				}
				if tc.status >= 300 && tc.status < 400 {
					w.Header().Set("Location", "/elsewhere")
				}
				w.WriteHeader(tc.status)
				_, _ = io.WriteString(w, `{"error":"nope"}`)
			})
			s := newTestWebhookSink(t, rcv.URL, "")
			s.now = func() time.Time { return now }
			err := s.Publish(context.Background(), whEvent())

			var ra *outbox.RetryAfterError
			switch tc.want {
			case "ok":
				if err != nil {
					t.Fatalf("err = %v, want success", err)
				}
			case "permanent":
				if !outbox.IsPermanent(err) || outbox.IsUnavailable(err) {
					t.Fatalf("err = %v, want permanent", err)
				}
				if errors.As(err, &ra) {
					t.Fatalf("permanent error must not carry Retry-After: %v", err)
				}
			case "transient", "unavailable":
				if err == nil || outbox.IsPermanent(err) {
					t.Fatalf("err = %v, want transient", err)
				}
				// outbox.Unavailable: the receiver is down, the event keeps its
				// attempts; transient: this event failed, it spends one.
				if got := outbox.IsUnavailable(err); got != (tc.want == "unavailable") {
					t.Fatalf("outbox.IsUnavailable(%v) = %v, want %v", err, got, !got)
				}
				if tc.after < 0 {
					if errors.As(err, &ra) {
						t.Fatalf("err = %v carries After=%s; want none", err, ra.After)
					}
				} else if !errors.As(err, &ra) || ra.After != tc.after {
					t.Fatalf("err = %#v, want *outbox.RetryAfterError with After=%s", err, tc.after)
				}
			}
			if err != nil {
				if !strings.Contains(err.Error(), strconv.Itoa(tc.status)) || !strings.Contains(err.Error(), "nope") {
					t.Errorf("error %q should name the status and quote the answer", err)
				}
			}
			if n := len(rcv.requests()); n != 1 {
				t.Errorf("receiver got %d requests, want 1 (redirects are not followed)", n)
			}
		})
	}
}

func TestWebhookSinkConnectionRefusedIsTransient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	s := newTestWebhookSink(t, "http://"+addr+"/hook", "")
	err = s.Publish(context.Background(), whEvent())
	if !outbox.IsUnavailable(err) {
		t.Fatalf("err = %v, want the receiver unavailable", err)
	}
	var u *outbox.UnavailableError
	if !errors.As(err, &u) {
		t.Errorf("err = %v, want it wrapped as an UnavailableError", err)
	}
	var ra *outbox.RetryAfterError
	if errors.As(err, &ra) {
		t.Errorf("a network error has no Retry-After: %v", err)
	}
}

func TestWebhookSinkTimeoutIsTransient(t *testing.T) {
	release := make(chan struct{})
	rcv := newWHReceiver(t, func(w http.ResponseWriter, r *http.Request) {
		select { // hang until the client gives up
		case <-r.Context().Done():
		case <-release:
		}
	})
	t.Cleanup(func() { close(release) }) // runs before rcv.Close
	s, err := New(outboxconfig.WebhookConfig{URL: rcv.URL, Timeout: 100 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = s.Publish(context.Background(), whEvent())
	if !outbox.IsUnavailable(err) {
		t.Fatalf("err = %v, want the receiver unavailable", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want it to wrap context.DeadlineExceeded", err)
	}
}

func TestWebhookSinkCallerCancelIsTransient(t *testing.T) {
	rcv := newWHReceiver(t, nil)
	s := newTestWebhookSink(t, rcv.URL, "")
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // shutdown: the relay hands the claim back, it must not go DEAD
	err := s.Publish(ctx, whEvent())
	if err == nil || outbox.IsPermanent(err) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want transient context.Canceled", err)
	}
}

func TestWebhookSinkErrorsNeverContainSecret(t *testing.T) {
	const rawKey = "s3cr3t-signing-key-do-not-log"
	whsec := "whsec_" + base64.StdEncoding.EncodeToString([]byte(rawKey))
	for _, secret := range []string{rawKey, whsec} {
		b64 := strings.TrimPrefix(secret, "whsec_")
		leaks := func(t *testing.T, err error) {
			t.Helper()
			if err == nil {
				t.Fatal("want an error")
			}
			for _, s := range []string{secret, b64, rawKey} {
				if strings.Contains(err.Error(), s) || strings.Contains(fmt.Sprintf("%+v", err), s) {
					t.Fatalf("error leaks the secret: %v", err)
				}
			}
		}
		// A receiver that knows the secret and echoes it back.
		rcv := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, "bad signature for "+secret+" / "+rawKey)
		})
		s := newTestWebhookSink(t, rcv.URL, secret)
		leaks(t, s.Publish(context.Background(), whEvent()))
		if str := fmt.Sprintf("%v %s", s, s); strings.Contains(str, b64) || strings.Contains(str, rawKey) {
			t.Fatalf("formatting the sink leaks the secret: %s", str)
		}

		rcv5 := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, secret)
		})
		leaks(t, newTestWebhookSink(t, rcv5.URL, secret).Publish(context.Background(), whEvent()))

		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		leaks(t, newTestWebhookSink(t, "http://"+addr, secret).Publish(context.Background(), whEvent()))
	}

	// A malformed whsec_ secret is a config error that must not quote it.
	bad := "whsec_not*base64*" + rawKey
	_, err := New(outboxconfig.WebhookConfig{URL: "https://hooks.example.com", Secret: bad, Timeout: time.Second}, nil)
	if err == nil || strings.Contains(err.Error(), rawKey) || strings.Contains(err.Error(), "not*base64") {
		t.Fatalf("err = %v, want an error that does not quote the secret", err)
	}
	if !strings.Contains(err.Error(), "outbox.webhook.secret") || !strings.Contains(err.Error(), "APP_OUTBOX_WEBHOOK_SECRET") {
		t.Errorf("err = %v, want it to name the key", err)
	}
}

func TestWebhookSinkErrorsHideURLCredentials(t *testing.T) {
	rcv := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusForbidden) })
	u := strings.Replace(rcv.URL, "http://", "http://hookuser:pw-in-url@", 1) + "/in?token=tok-in-query"
	err := newTestWebhookSink(t, u, "").Publish(context.Background(), whEvent())
	if !outbox.IsPermanent(err) {
		t.Fatalf("err = %v, want permanent", err)
	}

	ln, lerr := net.Listen("tcp", "127.0.0.1:0")
	if lerr != nil {
		t.Fatal(lerr)
	}
	addr := ln.Addr().String()
	ln.Close()
	netErr := newTestWebhookSink(t, "http://hookuser:pw-in-url@"+addr+"/in?token=tok-in-query", "").Publish(context.Background(), whEvent())
	if netErr == nil {
		t.Fatal("want a connection error")
	}
	for _, e := range []error{err, netErr} {
		if strings.Contains(e.Error(), "pw-in-url") || strings.Contains(e.Error(), "tok-in-query") {
			t.Errorf("error leaks URL credentials: %v", e)
		}
		if !strings.Contains(e.Error(), "/in") {
			t.Errorf("error should still name the endpoint: %v", e)
		}
	}
}

func TestWebhookSinkErrorBodySnippetIsShort(t *testing.T) {
	rcv := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, strings.Repeat("A", maxErrorBody)+strings.Repeat("Z", 50_000))
	})
	err := newTestWebhookSink(t, rcv.URL, "").Publish(context.Background(), whEvent())
	if !outbox.IsPermanent(err) {
		t.Fatalf("err = %v, want permanent", err)
	}
	if !strings.Contains(err.Error(), strings.Repeat("A", maxErrorBody)) || strings.Contains(err.Error(), "Z") {
		t.Errorf("error should quote exactly the first %d bytes of the answer; got %d bytes: %.300q", maxErrorBody, len(err.Error()), err)
	}
}

func TestNewWebhookSinkValidatesConfig(t *testing.T) {
	bad := []outboxconfig.WebhookConfig{
		{URL: "", Timeout: time.Second},
		{URL: "hooks.example.com/outbox", Timeout: time.Second},
		{URL: "/outbox", Timeout: time.Second},
		{URL: "ftp://hooks.example.com/outbox", Timeout: time.Second},
		{URL: "http://", Timeout: time.Second},
		{URL: "https://user:hunter2@ho st/x", Timeout: time.Second},
		{URL: "ftp://user:hunter2@hooks.example.com", Timeout: time.Second},
		{URL: "://bad", Timeout: time.Second},
		{URL: "http://hooks.example.com:99999/outbox", Timeout: time.Second},
		{URL: "http://hooks.example.com:65536/outbox", Timeout: time.Second},
		{URL: "https://user:hunter2@hooks.example.com:0/outbox", Timeout: time.Second},
		{URL: "http://hooks.example.com:http/outbox", Timeout: time.Second},
		{URL: "http://[::1]:123456/outbox", Timeout: time.Second},
	}
	for _, cfg := range bad {
		_, err := New(cfg, nil)
		if err == nil {
			t.Errorf("URL %q accepted", cfg.URL)
			continue
		}
		if !strings.Contains(err.Error(), "outbox.webhook.url") || !strings.Contains(err.Error(), "APP_OUTBOX_WEBHOOK_URL") {
			t.Errorf("URL %q: error %q should name outbox.webhook.url and APP_OUTBOX_WEBHOOK_URL", cfg.URL, err)
		}
		if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("URL %q: error leaks the password: %v", cfg.URL, err)
		}
	}

	for _, d := range []time.Duration{0, -time.Second} {
		_, err := New(outboxconfig.WebhookConfig{URL: "https://hooks.example.com", Timeout: d}, nil)
		if err == nil || !strings.Contains(err.Error(), "outbox.webhook.timeout") {
			t.Errorf("timeout %s: err = %v, want one naming outbox.webhook.timeout", d, err)
		}
	}

	for _, u := range []string{"http://127.0.0.1:8080/hook", "https://hooks.example.com/a/b?tenant=7",
		"http://hooks.example.com:1/x", "https://hooks.example.com:65535/x", "http://[::1]:8080/x", "http://hooks.example.com:/x"} {
		if _, err := New(outboxconfig.WebhookConfig{URL: u, Timeout: time.Second}, nil); err != nil {
			t.Errorf("URL %q rejected: %v", u, err)
		}
	}
}

// User info in the URL is sent as Basic auth, as http.Client would send
// it; an Authorization header stored with the event never replaces it.
func TestWebhookSinkSendsURLUserInfoAsBasicAuth(t *testing.T) {
	rcv := newWHReceiver(t, nil)
	u := strings.Replace(rcv.URL, "http://", "http://hookuser:pw%40in-url@", 1)
	s := newTestWebhookSink(t, u, "")
	if err := s.Publish(context.Background(), whEvent()); err != nil {
		t.Fatal(err)
	}
	e := whEvent()
	e.Headers = map[string]string{"AUTHORIZATION": "Bearer from-the-event"}
	if err := s.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	reqs := rcv.requests()
	if len(reqs) != 2 {
		t.Fatalf("receiver got %d requests, want 2", len(reqs))
	}
	for i, req := range reqs {
		r := http.Request{Header: req.Header}
		if user, pass, ok := r.BasicAuth(); !ok || user != "hookuser" || pass != "pw@in-url" || len(req.Header.Values("Authorization")) != 1 {
			t.Errorf("request %d: Basic auth = %q, %q, %v (Authorization %q); want only hookuser, pw@in-url", i, user, pass, ok, req.Header.Values("Authorization"))
		}
	}
}

// An https URL is verified against the trusted roots: a receiver whose
// certificate does not verify gets nothing, and the failure is transient.
func TestWebhookSinkHTTPS(t *testing.T) {
	var got atomic.Pointer[http.Request]
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Store(r)
		w.WriteHeader(http.StatusNoContent)
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake below is expected
	srv.StartTLS()
	t.Cleanup(srv.Close)

	err := newTestWebhookSink(t, srv.URL, "").Publish(context.Background(), whEvent())
	if err == nil || outbox.IsPermanent(err) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("err = %v, want a transient certificate error", err)
	}
	if got.Load() != nil {
		t.Fatal("the receiver got a request over an unverified connection")
	}

	s, err := New(outboxconfig.WebhookConfig{URL: srv.URL, Timeout: 5 * time.Second}, srv.Client().Transport) // trusts the test certificate
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(context.Background(), whEvent()); err != nil {
		t.Fatal(err)
	}
	r := got.Load()
	if r == nil || r.TLS == nil || r.Header.Get("Ce-Id") != whEvent().EventID {
		t.Fatalf("request = %+v, want the event over TLS", r)
	}
}

// Several relays share one sink.
func TestWebhookSinkConcurrentPublishers(t *testing.T) {
	const publishers, each = 6, 40
	key := []byte("concurrent-key")
	rcv := newWHReceiver(t, nil)
	s := newTestWebhookSink(t, rcv.URL, string(key))

	var wg sync.WaitGroup
	start := make(chan struct{})
	for p := range publishers {
		wg.Go(func() {
			<-start
			for i := range each {
				e := whEvent()
				e.EventID = fmt.Sprintf("evt-%d-%d", p, i)
				e.Payload = json.RawMessage(fmt.Sprintf(`{"p":%d,"i":%d}`, p, i))
				if err := s.Publish(context.Background(), e); err != nil {
					t.Error(err)
				}
			}
		})
	}
	close(start)
	wg.Wait()

	seen := map[string]bool{}
	for _, r := range rcv.requests() {
		id := r.Header.Get("Ce-Id")
		if seen[id] {
			t.Errorf("event %s delivered twice", id)
		}
		seen[id] = true
		if !verifyStandardWebhook(key, r.Header, r.Body) {
			t.Errorf("event %s: signature does not verify", id)
		}
	}
	if len(seen) != publishers*each {
		t.Fatalf("receiver saw %d events, want %d", len(seen), publishers*each)
	}
}

// BenchmarkWebhook compares the sink with bare http.Client posts of the
// same body to the same local receiver, in one run so noise hits all alike:
//   - sink: Publish, with a whsec_ secret (signing on);
//   - bare-post: Content-Type only, the floor of any HTTP sink;
//   - bare-post-same-headers: the exact headers the sink sends, prebuilt, so
//     sink/this is the sink's own work (building, signing, classifying)
//     and this/bare-post is what the wire format costs.
func BenchmarkWebhook(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	s, err := New(outboxconfig.WebhookConfig{URL: srv.URL, Secret: "whsec_" + base64.StdEncoding.EncodeToString(make([]byte, 32)), Timeout: 5 * time.Second}, nil)
	if err != nil {
		b.Fatal(err)
	}
	e := whEvent()
	ctx := context.Background()
	c := srv.Client()
	post := func(b *testing.B, h http.Header) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(string(e.Payload)))
		if err != nil {
			b.Fatal(err)
		}
		req.Header = h.Clone()
		resp, err := c.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}

	b.Run("sink", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := s.Publish(ctx, e); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("bare-post", func(b *testing.B) {
		h := http.Header{"Content-Type": {"application/json"}}
		b.ReportAllocs()
		for b.Loop() {
			post(b, h)
		}
	})
	b.Run("bare-post-same-headers", func(b *testing.B) {
		h := s.headers(e, e.OccurredAt.UTC().Format(time.RFC3339Nano), e.Payload)
		b.ReportAllocs()
		for b.Loop() {
			post(b, h)
		}
	})
}

// startCountingConns starts srv and counts the connections it accepts.
func startCountingConns(t *testing.T, srv *httptest.Server) *atomic.Int32 {
	var accepted atomic.Int32
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			accepted.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return &accepted
}

// An answer with a body is read to its end (up to maxDrain), so the
// connection goes back to the pool instead of being closed.
func TestWebhookSinkDrainsAnswersToReuseTheConnection(t *testing.T) {
	t.Parallel()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, strings.Repeat("accepted ", 500)) // 200 with a body the sink does not need
	}))
	dialed := startCountingConns(t, srv)
	s := newTestWebhookSink(t, srv.URL, "")
	for range 5 {
		if err := s.Publish(context.Background(), whEvent()); err != nil {
			t.Fatal(err)
		}
	}
	if n := dialed.Load(); n != 1 {
		t.Errorf("5 publishes one after another opened %d connections, want 1", n)
	}
}

// Publishes in flight at once each hold a connection, and the sink keeps
// them all alive for the next ones: net/http's default of 2 idle
// connections per host would make every further publish dial anew. The
// receiver holds each burst until all of it has arrived, so a burst
// really needs `inFlight` connections at once.
func TestWebhookSinkReusesConnectionsOfConcurrentPublishes(t *testing.T) {
	t.Parallel()
	const inFlight, bursts = 8, 3
	arrived := make(chan struct{})
	var release atomic.Pointer[chan struct{}]
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gate := *release.Load()
		arrived <- struct{}{}
		<-gate
		w.WriteHeader(http.StatusNoContent)
	}))
	dialed := startCountingConns(t, srv)
	s := newTestWebhookSink(t, srv.URL, "")

	for burst := range bursts {
		gate := make(chan struct{})
		release.Store(&gate)
		errs := make(chan error, inFlight)
		for i := range inFlight {
			go func() {
				e := whEvent()
				e.EventID = fmt.Sprintf("evt-%d-%d", burst, i)
				errs <- s.Publish(context.Background(), e)
			}()
		}
		for range inFlight {
			select {
			case <-arrived:
			case <-time.After(10 * time.Second):
				t.Fatalf("burst %d: the receiver did not see %d requests at once", burst, inFlight)
			}
		}
		close(gate)
		for range inFlight {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := dialed.Load(); n != inFlight {
		t.Errorf("%d bursts of %d concurrent publishes opened %d connections, want %d (one per publish in flight, then reused)",
			bursts, inFlight, n, inFlight)
	}
}

// Credentials, hop-by-hop and framing headers and the sink's own are
// dropped from the stored headers, in any case, and docs/brokers/webhook.md lists
// every one of them; other headers pass through.
func TestWebhookSinkDropsCredentialHopByHopAndOwnHeaders(t *testing.T) {
	rcv := newWHReceiver(t, nil)
	s := newTestWebhookSink(t, strings.Replace(rcv.URL, "http://", "http://hookuser:pw@", 1), "whsec_"+base64.StdEncoding.EncodeToString([]byte("k")))
	e := whEvent()
	e.Headers = map[string]string{"X-Tenant": "acme", "traceparent": e.Headers["traceparent"]}
	var names []string
	for n := range droppedHeaders {
		names = append(names, n)
	}
	names = append(names, "proxy-authorization", "proxy-connection", "ce-id", "webhook-signature")
	for _, n := range names {
		for _, variant := range []string{n, strings.ToUpper(n), http.CanonicalHeaderKey(n)} {
			e.Headers[variant] = "from-the-producer"
		}
	}
	if err := s.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	got := rcv.only(t)
	if got.Header.Get("X-Tenant") != "acme" || got.Header.Get("Traceparent") == "" {
		t.Errorf("other headers must pass through: %v", got.Header)
	}
	// What the sink built, before net/http or the receiver touch it.
	built := s.headers(e, "2024-01-01T00:00:00Z", e.Payload)
	for k, vals := range built {
		for _, v := range vals {
			if v == "from-the-producer" {
				t.Errorf("header %s from the producer was sent", k)
			}
		}
	}
	for k, vals := range got.Header {
		if slices.Contains(vals, "from-the-producer") {
			t.Errorf("receiver got the producer's %s", k)
		}
	}
	if r := (http.Request{Header: got.Header}); func() bool { u, p, ok := r.BasicAuth(); return !ok || u != "hookuser" || p != "pw" }() {
		t.Errorf("Authorization = %q, want the URL's credentials", got.Header.Values("Authorization"))
	}

	doc, err := os.ReadFile("../../../../docs/brokers/webhook.md")
	if err != nil {
		t.Fatal(err)
	}
	for n := range droppedHeaders {
		if !strings.Contains(strings.ToLower(string(doc)), "`"+n+"`") {
			t.Errorf("docs/brokers/webhook.md does not list the dropped header `%s`", n)
		}
	}
}

// A receiver's error answer reaches last_error, the log and `outbox dead
// list` bounded and with the credentials it echoes masked.
func TestWebhookSinkMasksCredentialsInErrorAnswers(t *testing.T) {
	leaks := []string{"tok-abc123", "pw-in-query", "sec-xyz", "dXNlcjpwYXNz", "eyJhbGciOi.payload.sig", "url-pass", "url-user", "key-987"}
	answers := []string{
		`{"error":"unauthorized","headers":{"Authorization":"Bearer eyJhbGciOi.payload.sig"}}`,
		"Authorization: Basic dXNlcjpwYXNz\r\nbad request",
		`rejected GET /hook?token=tok-abc123&password=pw-in-query&client_secret=sec-xyz&page=2`,
		`{"api_key": "key-987", "message": "bad"}`,
		`upstream https://url-user:url-pass@internal.example/x failed`,
		`bearer tok-abc123 expired`,
	}
	for _, answer := range answers {
		rcv := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, answer)
		})
		err := newTestWebhookSink(t, rcv.URL, "").Publish(context.Background(), whEvent())
		if !outbox.IsPermanent(err) {
			t.Fatalf("err = %v, want permanent", err)
		}
		for _, l := range leaks {
			if strings.Contains(err.Error(), l) {
				t.Errorf("answer %q: error quotes the credential %q: %v", answer, l, err)
			}
		}
		if !strings.Contains(err.Error(), "xxxxx") {
			t.Errorf("answer %q: want the masked credential marked: %v", answer, err)
		}
	}
	// What is not a credential stays readable.
	rcv := newWHReceiver(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":"field order_id missing","page":2}`)
	})
	err := newTestWebhookSink(t, rcv.URL, "").Publish(context.Background(), whEvent())
	if err == nil || !strings.Contains(err.Error(), "field order_id missing") {
		t.Errorf("err = %v, want the answer quoted", err)
	}
}

// TestSinksWriteRFC3339: the webhook's ce-time is RFC 3339 for years
// 0001-9999; an event outside them is a permanent error and nothing is
// sent (the log sink's occurred_at: outbox's test of the same name).
func TestSinksWriteRFC3339(t *testing.T) {
	t.Parallel()
	rcv := newWHReceiver(t, nil)
	wh := newTestWebhookSink(t, rcv.URL, "")
	for _, c := range []struct {
		at   time.Time
		want string // "" = refused
	}{
		{time.Date(1, 1, 1, 12, 0, 0, 0, time.UTC), "0001-01-01T12:00:00Z"},
		{time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC), "9999-12-31T23:59:59.999999Z"},
		{time.Date(2024, 5, 6, 9, 8, 9, 0, time.FixedZone("+02", 7200)), "2024-05-06T07:08:09Z"},
		{time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), ""},
		{time.Date(-3999, 1, 1, 0, 0, 0, 0, time.UTC), ""},
		{time.Date(0, 12, 31, 23, 0, 0, 0, time.UTC), ""},
	} {
		e := whEvent()
		e.OccurredAt = c.at
		before := len(rcv.requests())
		werr := wh.Publish(context.Background(), e)
		if c.want == "" {
			if !outbox.IsPermanent(werr) || !strings.Contains(werr.Error(), "outbox_event_occurred_at_range") {
				t.Errorf("%s: webhook %v; want a permanent error naming the rule", c.at, werr)
			}
			if len(rcv.requests()) != before {
				t.Errorf("%s: an event without an RFC 3339 time was sent", c.at)
			}
			continue
		}
		if werr != nil {
			t.Fatalf("%s: webhook %v", c.at, werr)
		}
		reqs := rcv.requests()
		if got := reqs[len(reqs)-1].Header.Get("Ce-Time"); got != c.want {
			t.Errorf("ce-time %q, want %q", got, c.want)
		}
		if _, err := time.Parse(time.RFC3339Nano, reqs[len(reqs)-1].Header.Get("Ce-Time")); err != nil {
			t.Error(err)
		}
	}
}
