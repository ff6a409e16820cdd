package webhook

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Every refusal is counted by its reason and says it in the answer's
// body; the log has a line for each while under its rate, with
// error.code, and never more than its burst and one a second after.
func TestRefusalsCountedByReason(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.start(t)
	body := []byte(`{"n": 1}`)
	const badSigs = 60
	for range badSigs {
		a := post(t, f.url, signed([]byte("a wrong secret"), "w-1", time.Now(), body), body)
		if a.code != http.StatusUnauthorized || a.body.Reason != reasonBadSignature {
			t.Fatalf("wrong secret: %+v, want 401 bad_signature", a)
		}
	}
	big := []byte(strings.Repeat("x", int(f.src.cfg.MaxBody)+1))
	if a := post(t, f.url, signed(f.key, "big", time.Now(), big), big); a.code != http.StatusRequestEntityTooLarge || a.body.Reason != reasonTooLarge {
		t.Errorf("too large: %+v, want 413 too_large", a)
	}
	resp, err := http.Get(f.url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET: %d, want 405", resp.StatusCode)
	}
	if a := post(t, strings.TrimSuffix(f.url, "/inbox")+"/elsewhere", signed(f.key, "e", time.Now(), body), body); a.code != http.StatusNotFound || a.body.Reason != reasonNotFound {
		t.Errorf("another path: %+v, want 404 not_found", a)
	}
	for reason, want := range map[string]float64{
		reasonBadSignature: badSigs, reasonTooLarge: 1, reasonMethod: 1, reasonNotFound: 1, reasonBusy: 0, reasonSlowBody: 0,
	} {
		if got := f.refusedCount(t, reason); got != want {
			t.Errorf("inbox_webhook_refused_total{reason=%q} = %v, want %v", reason, got, want)
		}
	}
	lines := f.logs.Lines(t, "inbox webhook request refused")
	if len(lines) < refusedLogBurst || len(lines) >= badSigs {
		t.Errorf("%d log lines for %d refusals in a burst, want between %d and a few more", len(lines), badSigs+3, refusedLogBurst)
	}
	for _, l := range lines {
		if l["error.code"] != "INBOX_WEBHOOK_REFUSED" || l["reason"] == nil || l["remote_addr"] == nil {
			t.Errorf("log line %v: want error.code, reason and remote_addr", l)
		}
		if strings.Contains(f.logs.String(), f.secret) {
			t.Fatal("the log holds the secret")
		}
	}
	f.nothingStored(t)
}

// The three 503s say which they are: the same message in progress
// elsewhere, the database failing, the receiver full (see
// TestFloodPastTheCap).
func TestServiceUnavailableSaysWhy(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	if _, err := f.db.Pool.Exec(context.Background(), `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, owner, lease_token, lease_until)
VALUES ('hook', 'order', 'held', 'RECEIVED', 'another-replica', 1, now() + interval '30s')`); err != nil {
		t.Fatal(err)
	}
	f.start(t)
	body := []byte(`{}`)
	a := post(t, f.url, signed(f.key, "held", time.Now(), body), body)
	if a.code != http.StatusServiceUnavailable || a.body.Reason != reasonInProgress || a.retryAfter == "" {
		t.Errorf("a message another claim holds: %+v, want 503 in_progress with Retry-After", a)
	}

	// A consumer whose pool is closed: every inbox transaction fails.
	down := newFixture(t, func(s *setup) {
		pool, err := pgxpool.New(context.Background(), f.db.URL)
		if err != nil {
			t.Fatal(err)
		}
		pool.Close()
		s.consumerPool = pool
	})
	down.start(t)
	a = post(t, down.url, signed(down.key, "m", time.Now(), body), body)
	if a.code != http.StatusServiceUnavailable || a.body.Reason != reasonUnavailable || a.retryAfter == "" {
		t.Errorf("the database failing: %+v, want 503 unavailable with Retry-After", a)
	}
	if f.refusedCount(t, reasonInProgress) != 1 || down.refusedCount(t, reasonUnavailable) != 1 {
		t.Error("the 503s are not counted by their reasons")
	}
}

// The configured key wins over webhook-id: a sender that gives each
// retry a new webhook-id (or a second sender of the same event) has the
// event applied once. A request without the configured key is 400 and
// stores nothing. A request with ce-id is keyed by CloudEvents, like
// every source's.
func TestConfiguredKeyWinsOverWebhookID(t *testing.T) {
	t.Parallel()
	f := newFixture(t, func(s *setup) { s.dedupe = "field:event_id" })
	f.start(t)
	foreign := func(webhookID string, body []byte) http.Header {
		h := signed(f.key, webhookID, time.Now(), body)
		for _, ce := range []string{"Ce-Id", "Ce-Source", "Ce-Type", "Ce-Subject", "Ce-Specversion"} {
			h.Del(ce)
		}
		return h
	}
	body := []byte(`{"event_id": "evt-7", "amount": 3}`)
	if a := post(t, f.url, foreign("msg_a", body), body); a.code != http.StatusOK || a.body.Outcome != "processed" {
		t.Fatalf("first: %+v, want 200 processed", a)
	}
	if a := post(t, f.url, foreign("msg_b", body), body); a.code != http.StatusOK || a.body.Outcome != "duplicate" {
		t.Errorf("the same event under another webhook-id: %+v, want 200 duplicate", a)
	}
	if n := f.count(t, `SELECT count(*) FROM work WHERE msg_id = 'evt-7' AND msg_source = ''`); n != 1 {
		t.Errorf("the event applied %d times under its key, want once", n)
	}
	none := []byte(`{"amount": 3}`)
	if a := post(t, f.url, foreign("msg_c", none), none); a.code != http.StatusBadRequest || a.body.Reason != reasonBadRequest || !strings.Contains(a.body.Error, "event_id") {
		t.Errorf("without the key: %+v, want 400 bad_request naming event_id", a)
	}
	withCE := []byte(`{"event_id": "evt-7"}`)
	if a := post(t, f.url, signed(f.key, "ce-1", time.Now(), withCE), withCE); a.code != http.StatusOK || a.body.Outcome != "processed" {
		t.Errorf("a CloudEvent: %+v, want 200 processed under its ce-source and ce-id", a)
	}
	if n := f.count(t, `SELECT count(*) FROM inbox_message`); n != 2 {
		t.Errorf("%d inbox rows, want evt-7's and the CloudEvent's", n)
	}

	// Without a configured key, the webhook-id is the key.
	g := newFixture(t)
	g.start(t)
	for _, id := range []string{"msg_a", "msg_a", "msg_b"} {
		h := signed(g.key, id, time.Now(), body)
		h.Del("Ce-Id")
		post(t, g.url, h, body)
	}
	if n := g.count(t, `SELECT count(*) FROM work`); n != 2 {
		t.Errorf("without a key: %d pieces of work for two webhook-ids, want 2", n)
	}
}
