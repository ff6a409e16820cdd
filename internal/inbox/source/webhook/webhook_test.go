package webhook

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	webhooksink "github.com/worker-dev/worker/internal/outbox/sink/webhook"
	"github.com/worker-dev/worker/internal/testkit"
)

// An event our outbox webhook sink sends verifies and is processed once:
// the sink sees success both times, and the second POST does no work.
// The source holds two secrets, as while rotating; the sink signs with
// the second.
func TestOutboxWebhookSinkEventProcessedOnce(t *testing.T) {
	t.Parallel()
	old := "whsec_" + base64.StdEncoding.EncodeToString([]byte("the secret before the rotation"))
	f := newFixture(t, func(s *setup) { s.cfg.Secret = old + " " + s.cfg.Secret })
	f.start(t)
	s, err := webhooksink.New(outboxconfig.WebhookConfig{URL: f.url, Secret: f.secret, Timeout: 10 * time.Second}, nil)
	if err != nil {
		t.Fatal(err)
	}
	e := outbox.Event{
		EventID: uuid.NewString(), AggregateType: "order", AggregateID: "o 7/ü", EventType: "order.paid",
		Payload: json.RawMessage(`{"amount": 7}`), OccurredAt: time.Now(), Headers: map[string]string{"traceparent": "00-abc-01"},
	}
	for range 2 {
		if err := s.Publish(context.Background(), e); err != nil {
			t.Fatalf("the sink's POST failed: %v", err)
		}
	}
	var src, id, orderKey string
	err = f.db.Pool.QueryRow(context.Background(), `SELECT msg_source, msg_id, order_key FROM work`).Scan(&src, &id, &orderKey)
	if err != nil {
		t.Fatalf("the work of the event: %v", err)
	}
	if src != "order" || id != e.EventID || orderKey != "order/o 7/ü" {
		t.Errorf("work for %s/%s under %q; want order/%s under order/o 7/ü", src, id, orderKey, e.EventID)
	}
	if n := f.count(t, `SELECT count(*) FROM work`); n != 1 {
		t.Errorf("%d pieces of work for one event sent twice", n)
	}
	if v, _ := testkit.Metric(t, f.reg, "inbox_received_total", map[string]string{"source": "hook", "outcome": "duplicate"}); v != 1 {
		t.Errorf("inbox_received_total{duplicate} = %v, want 1", v)
	}
}

// A processed message is answered 200 only once its row says PROCESSED;
// the same message again is a duplicate (200 by default, 409 if so
// configured) and does no second piece of work.
func TestDuplicatePost(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusOK, http.StatusConflict} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, func(s *setup) { s.cfg.DuplicateStatus = status })
			f.start(t)
			body := []byte(`{"n": 1}`)
			first := post(t, f.url, signed(f.key, "m-1", time.Now(), body), body)
			if first.code != http.StatusOK || first.body.Outcome != "processed" {
				t.Fatalf("first POST: %+v", first)
			}
			if n := f.count(t, `SELECT count(*) FROM inbox_message WHERE msg_id = 'm-1' AND state = 'PROCESSED'`); n != 1 {
				t.Errorf("answered 200 before the commit")
			}
			again := post(t, f.url, signed(f.key, "m-1", time.Now(), body), body)
			if again.code != status || again.body.Outcome != "duplicate" {
				t.Errorf("second POST: %+v, want %d duplicate", again, status)
			}
			if n := f.count(t, `SELECT count(*) FROM work`); n != 1 {
				t.Errorf("%d pieces of work for one message", n)
			}
		})
	}
}

// A request without a valid signature is 401 and stores nothing.
func TestBadSignature(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.start(t)
	body := []byte(`{"n": 1}`)
	for name, h := range map[string]http.Header{
		"unsigned":   {"Content-Type": {"application/json"}, "Ce-Id": {"m"}, "Ce-Source": {"order"}},
		"other key":  signed([]byte("not the secret"), "m", time.Now(), body),
		"stale":      signed(f.key, "m", time.Now().Add(-10*time.Minute), body),
		"future":     signed(f.key, "m", time.Now().Add(10*time.Minute), body),
		"another id": func() http.Header { h := signed(f.key, "m", time.Now(), body); h.Set("Webhook-Id", "n"); return h }(),
		"v2 only": func() http.Header {
			h := signed(f.key, "m", time.Now(), body)
			h.Set("Webhook-Signature", "v2"+h.Get("Webhook-Signature")[2:])
			return h
		}(),
		"not base64": func() http.Header {
			h := signed(f.key, "m", time.Now(), body)
			h.Set("Webhook-Signature", "v1,???")
			return h
		}(),
		"bad seconds": func() http.Header {
			h := signed(f.key, "m", time.Now(), body)
			h.Set("Webhook-Timestamp", "soon")
			return h
		}(),
	} {
		if a := post(t, f.url, h, body); a.code != http.StatusUnauthorized || a.body.Error == "" {
			t.Errorf("%s: %+v, want 401 with a reason", name, a)
		}
	}
	// The body signed is the body received.
	if a := post(t, f.url, signed(f.key, "m", time.Now(), body), []byte(`{"n": 2}`)); a.code != http.StatusUnauthorized {
		t.Errorf("tampered body: %d, want 401", a.code)
	}
	// One good signature among others verifies (a sender mid-rotation).
	h := signed(f.key, "m", time.Now(), body)
	h.Set("Webhook-Signature", "v1,AAAA "+h.Get("Webhook-Signature")+" v1a,xyz")
	if a := post(t, f.url, h, body); a.code != http.StatusOK {
		t.Errorf("a good signature among others: %+v, want 200", a)
	}
	if n := f.count(t, `SELECT count(*) FROM work`); n != 1 {
		t.Errorf("%d pieces of work; want only the verified message's", n)
	}
}

// A body over max_body is 413, with or without a Content-Length, and
// stores nothing; so is a GET 405.
func TestTooLargeAndNotPost(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.start(t)
	big := bytes.Repeat([]byte("x"), 10<<20)
	if a := post(t, f.url, signed(f.key, "big", time.Now(), big), big); a.code != http.StatusRequestEntityTooLarge {
		t.Errorf("10 MB body: %d, want 413", a.code)
	}
	// Chunked: the length shows only while reading.
	req, err := http.NewRequest(http.MethodPost, f.url, struct{ *bytes.Reader }{bytes.NewReader(big)})
	if err != nil {
		t.Fatal(err)
	}
	req.Header = signed(f.key, "big", time.Now(), big)
	if a := do(t, req); a.code != http.StatusRequestEntityTooLarge {
		t.Errorf("10 MB chunked body: %d, want 413", a.code)
	}
	resp, err := http.Get(f.url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") == "" {
		t.Errorf("GET: %d, Allow %q; want 405 naming POST", resp.StatusCode, resp.Header.Get("Allow"))
	}
	f.nothingStored(t)
}

// A dead-lettered message is answered 200, saying so: resending it would
// only be a duplicate.
func TestDeadIsAnswered200(t *testing.T) {
	t.Parallel()
	f := newFixture(t, func(s *setup) {
		s.handler = inbox.HandlerFunc(func(context.Context, pgx.Tx, inbox.Message) error {
			return inbox.Permanent(errors.New("refused by the handler"))
		})
	})
	f.start(t)
	body := []byte(`{}`)
	a := post(t, f.url, signed(f.key, "d-1", time.Now(), body), body)
	if a.code != http.StatusOK || a.body.Outcome != "dead" {
		t.Errorf("dead message: %+v, want 200 dead", a)
	}
	if n := f.count(t, `SELECT count(*) FROM inbox_message WHERE msg_id = 'd-1' AND state = 'DEAD'`); n != 1 {
		t.Errorf("no dead letter")
	}
}

// The same message while its first delivery is being worked on waits for
// it (its claim waits on the row of the key), and is then answered as a
// duplicate: no second piece of work. A request whose work outlasts the
// timeout is 503.
func TestBusyAndTimeout(t *testing.T) {
	t.Parallel()
	entered, release := make(chan struct{}, 4), make(chan struct{})
	f := newFixture(t, func(s *setup) {
		s.cfg.Timeout = 10 * time.Second
		s.handler = inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
			entered <- struct{}{}
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
			return inbox.SQLHandler{SQL: workSQL}.Handle(ctx, tx, m)
		})
	})
	f.start(t)
	body := []byte(`{}`)
	first, second := make(chan response, 1), make(chan response, 1)
	go func() { first <- post(t, f.url, signed(f.key, "b-1", time.Now(), body), body) }()
	<-entered
	go func() { second <- post(t, f.url, signed(f.key, "b-1", time.Now(), body), body) }()
	testkit.Eventually(t, 10*time.Second, "the second delivery's claim to wait for the first", func() bool {
		return f.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 1
	})
	close(release)
	if a := <-first; a.code != http.StatusOK || a.body.Outcome != "processed" {
		t.Errorf("first: %+v, want 200 processed", a)
	}
	if a := <-second; a.code != http.StatusOK || a.body.Outcome != "duplicate" {
		t.Errorf("the same message meanwhile: %+v, want 200 duplicate once the first committed", a)
	}
	if n := f.count(t, `SELECT count(*) FROM work`); n != 1 {
		t.Errorf("%d pieces of work for one message", n)
	}

	// A handler that never finishes: the request's timeout ends it.
	f2 := newFixture(t, func(s *setup) {
		s.cfg.Timeout = 300 * time.Millisecond
		s.handler = inbox.HandlerFunc(func(ctx context.Context, _ pgx.Tx, _ inbox.Message) error {
			<-ctx.Done()
			return ctx.Err()
		})
	})
	f2.start(t)
	if a := post(t, f2.url, signed(f2.key, "slow", time.Now(), body), body); a.code != http.StatusServiceUnavailable || a.retryAfter == "" {
		t.Errorf("past the timeout: %+v, want 503 with Retry-After", a)
	}
}

// Past the cap on requests in flight, a request is 503 at once; the
// server keeps answering, and the requests it took finish.
func TestFloodPastTheCap(t *testing.T) {
	t.Parallel()
	const capacity, flood = 4, 40
	entered, release := make(chan struct{}, capacity), make(chan struct{})
	f := newFixture(t, func(s *setup) {
		s.opts.MaxInFlight = capacity
		s.handler = inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
			if strings.HasPrefix(m.ID, "held-") {
				entered <- struct{}{}
				<-release
			}
			return inbox.SQLHandler{SQL: workSQL}.Handle(ctx, tx, m)
		})
	})
	f.start(t)
	body := []byte(`{}`)
	held := make(chan response, capacity)
	for i := range capacity {
		id := "held-" + string(rune('a'+i))
		go func() { held <- post(t, f.url, signed(f.key, id, time.Now(), body), body) }()
	}
	for range capacity {
		<-entered
	}
	var wg sync.WaitGroup
	codes := make(chan response, flood)
	for i := range flood {
		id := fmt.Sprintf("flood-%d", i)
		wg.Go(func() { codes <- post(t, f.url, signed(f.key, id, time.Now(), body), body) })
	}
	wg.Wait()
	close(codes)
	for a := range codes {
		if a.code != http.StatusServiceUnavailable || a.retryAfter == "" {
			t.Errorf("past the cap: %+v, want 503 with Retry-After", a)
		}
	}
	close(release)
	for range capacity {
		if a := <-held; a.code != http.StatusOK {
			t.Errorf("a request within the cap: %+v, want 200", a)
		}
	}
	if a := post(t, f.url, signed(f.key, "after", time.Now(), body), body); a.code != http.StatusOK {
		t.Errorf("after the flood: %+v, want 200", a)
	}
	if n := f.count(t, `SELECT count(*) FROM work`); n != capacity+1 {
		t.Errorf("%d pieces of work, want %d: the refused requests must do none", n, capacity+1)
	}
}

// A request in flight when the source stops finishes and is answered; the
// source then stops listening.
func TestGracefulShutdown(t *testing.T) {
	t.Parallel()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	f := newFixture(t, func(s *setup) {
		s.handler = inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
			entered <- struct{}{}
			<-release
			return inbox.SQLHandler{SQL: workSQL}.Handle(ctx, tx, m)
		})
	})
	stop := f.start(t)
	body := []byte(`{}`)
	res := make(chan response, 1)
	go func() { res <- post(t, f.url, signed(f.key, "g-1", time.Now(), body), body) }()
	<-entered
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	testkit.Eventually(t, 10*time.Second, "the listener to close", func() bool {
		c, err := net.Dial("tcp", f.src.Addr())
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	close(release)
	if a := <-res; a.code != http.StatusOK {
		t.Errorf("the request in flight at shutdown: %+v, want 200", a)
	}
	<-stopped
}

// A taken address is a setup error from Run.
func TestListenError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	f := newFixture(t, func(s *setup) { s.cfg.Addr = ln.Addr().String() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.src.Run(ctx, f.c); !errors.Is(err, broker.ErrSetup) {
		t.Errorf("Run on a taken address: %v, want ErrSetup", err)
	}
}

// Bad sections are refused by New, never quoting the secret.
func TestNewRefuses(t *testing.T) {
	t.Parallel()
	good := inboxconfig.DefaultSource().Webhook
	good.Secret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("k"))
	for name, tweak := range map[string]func(*inboxconfig.WebhookSource){
		"no secret":        func(c *inboxconfig.WebhookSource) { c.Secret = "" },
		"bad whsec":        func(c *inboxconfig.WebhookSource) { c.Secret = "whsec_not*base64" },
		"relative path":    func(c *inboxconfig.WebhookSource) { c.Path = "inbox" },
		"duplicate status": func(c *inboxconfig.WebhookSource) { c.DuplicateStatus = 202 },
		"max body":         func(c *inboxconfig.WebhookSource) { c.MaxBody = 0 },
		"tolerance":        func(c *inboxconfig.WebhookSource) { c.Tolerance = 0 },
		"timeout":          func(c *inboxconfig.WebhookSource) { c.Timeout = 0 },
	} {
		c := good
		tweak(&c)
		_, err := New(c, Options{Name: "hook"})
		if err == nil {
			t.Errorf("%s: accepted", name)
		} else if strings.Contains(err.Error(), "not*base64") {
			t.Errorf("%s: the error quotes the secret: %v", name, err)
		}
	}
	if _, err := New(good, Options{Name: "hook"}); err != nil {
		t.Errorf("the default section with a secret: %v", err)
	}
}

// A signed request whose ce-id, ce-source or ce-subject decodes to text
// the database cannot store (%00, or bytes that are not UTF-8) is
// dead-lettered at once and answered 400, never 503; its resend is
// answered alike, and nothing else is held back.
func TestUnstorableIs400(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.start(t)
	body := []byte(`{}`)
	for n, set := range []func(h http.Header){
		func(h http.Header) { h.Set("Ce-Id", "nul%00id") },
		func(h http.Header) { h.Set("Ce-Source", "shop%00") },
		func(h http.Header) { h.Set("Ce-Subject", "o-%FF") },
	} {
		id := "u-" + strconv.Itoa(n)
		h := signed(f.key, id, time.Now(), body)
		set(h)
		for try := range 2 {
			a := post(t, f.url, h, body)
			if a.code != http.StatusBadRequest || a.body.Outcome != "dead" || !strings.Contains(a.body.Error, "unstorable") {
				t.Errorf("%s, try %d: %+v; want 400 dead, unstorable", id, try+1, a)
			}
		}
	}
	if n := f.count(t, `SELECT count(*) FROM inbox_message WHERE state = 'DEAD' AND last_error LIKE 'unstorable message:%'`); n != 3 {
		t.Errorf("%d dead letters; want the 3 unstorable messages", n)
	}
	if a := post(t, f.url, signed(f.key, "fine", time.Now(), body), body); a.code != http.StatusOK || a.body.Outcome != "processed" {
		t.Errorf("a good message after them: %+v, want 200 processed", a)
	}
}
