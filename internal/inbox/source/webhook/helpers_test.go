package webhook

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// workSQL is the sql handler of the tests: one row of work per message.
const workSQL = `INSERT INTO work (msg_source, msg_id, order_key) VALUES (@source, @id, @order_key)`

// fixture is one test's inbox: a database with a work table, the consumer
// of source "hook", and the source serving it on a local port.
type fixture struct {
	db     *pgtest.DB
	reg    *prometheus.Registry
	c      *inbox.Consumer
	src    *Source
	url    string // the source's POST URL
	secret string // whsec_ secret the source verifies with
	key    []byte
	logs   *testkit.LogBuffer // the source's log
}

// setup tunes a fixture before it starts: the source's section and
// options, and the handler (the sql handler when nil).
type setup struct {
	cfg     inboxconfig.WebhookSource
	opts    Options
	handler inbox.Handler
	dedupe  string // the source's configured key
	// consumerPool, when set, is the pool the consumer uses instead of
	// the test database's.
	consumerPool *pgxpool.Pool
}

func newFixture(t testing.TB, tweak ...func(*setup)) *fixture {
	t.Helper()
	key := make([]byte, 24)
	_, _ = rand.Read(key)
	f := &fixture{db: pgtest.New(t), reg: prometheus.NewRegistry(), key: key, secret: "whsec_" + base64.StdEncoding.EncodeToString(key), logs: &testkit.LogBuffer{}}
	if _, err := f.db.Pool.Exec(context.Background(), `CREATE TABLE work (
		n bigserial PRIMARY KEY, msg_source text, msg_id text, order_key text)`); err != nil {
		t.Fatal(err)
	}
	st := setup{cfg: inboxconfig.DefaultSource().Webhook, opts: Options{Name: "hook", Logger: f.logs.Logger(), Registerer: f.reg}}
	st.cfg.Addr, st.cfg.Path, st.cfg.Secret = "127.0.0.1:0", "/inbox", f.secret
	for _, tw := range tweak {
		tw(&st)
	}
	if st.handler == nil {
		st.handler = inbox.SQLHandler{SQL: workSQL}
	}
	cfg := inboxconfig.DefaultConfig()
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 100*time.Millisecond
	sc := inboxconfig.SourceConfig{Name: "hook", Kind: inboxconfig.KindWebhook, Key: st.dedupe, Handler: inboxconfig.HandlerConfig{Kind: inboxconfig.HandlerSQL, SQL: workSQL}}
	st.opts.Key = st.dedupe
	pool := f.db.Pool
	if st.consumerPool != nil {
		pool = st.consumerPool
	}
	f.c = inboxtest.NewConsumer(t, pool, sc, cfg, st.handler, f.reg)
	var err error
	if f.src, err = New(st.cfg, st.opts); err != nil {
		t.Fatal(err)
	}
	return f
}

// start runs the source until the returned stop is called or t ends.
func (f *fixture) start(t testing.TB) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.src.Run(ctx, f.c) }()
	testkit.Eventually(t, 10*time.Second, "the source to listen", func() bool {
		select {
		case err := <-done:
			t.Fatalf("Run returned before listening: %v", err)
		default:
		}
		return f.src.Addr() != ""
	})
	f.url = "http://" + f.src.Addr() + f.src.cfg.Path
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run after ctx ended: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Error("Run did not return within 20s of ctx ending")
		}
	}
	t.Cleanup(stop)
	return stop
}

// signed returns the Standard Webhooks headers of body, signed with key
// at ts, plus the CloudEvents headers of id.
func signed(key []byte, id string, ts time.Time, body []byte) http.Header {
	t := strconv.FormatInt(ts.Unix(), 10)
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(id + "." + t + "."))
	mac.Write(body)
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("Webhook-Id", id)
	h.Set("Webhook-Timestamp", t)
	h.Set("Webhook-Signature", "v1,"+base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	h.Set("Ce-Specversion", "1.0")
	h.Set("Ce-Id", id)
	h.Set("Ce-Source", "order")
	h.Set("Ce-Type", "order.updated")
	h.Set("Ce-Subject", "o-1")
	return h
}

// response is an answer, read.
type response struct {
	code       int
	retryAfter string
	body       reply
}

func post(t testing.TB, url string, h http.Header, body []byte) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header = h
	return do(t, req)
}

func do(t testing.TB, req *http.Request) response {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	a := response{code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After")}
	if len(b) > 0 {
		if err := json.Unmarshal(b, &a.body); err != nil {
			t.Errorf("answer %d is not JSON: %q", resp.StatusCode, b)
		}
	}
	return a
}

// count runs a query returning one number.
func (f *fixture) count(t testing.TB, q string, args ...any) int {
	t.Helper()
	return inboxtest.Scalar(t, f.db.Pool, q, args...)
}

// nothingStored checks that no work was done and no inbox row written.
func (f *fixture) nothingStored(t testing.TB) {
	t.Helper()
	if n := f.count(t, `SELECT (SELECT count(*) FROM work) + (SELECT count(*) FROM inbox_message)`); n != 0 {
		t.Errorf("%d rows of work or inbox", n)
	}
}

// refusedCount is inbox_webhook_refused_total of reason.
func (f *fixture) refusedCount(t testing.TB, reason string) float64 {
	t.Helper()
	v, ok := testkit.Metric(t, f.reg, "inbox_webhook_refused_total", map[string]string{"source": "hook", "reason": reason})
	if !ok {
		t.Fatalf("no inbox_webhook_refused_total{reason=%q}", reason)
	}
	return v
}
