package nats

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

const (
	testStream  = "IN"
	testSubject = "in.orders"
)

// testServer is an in-process nats-server with JetStream on file storage,
// so a restart keeps the stream and the consumer.
type testServer struct {
	opts *server.Options
	srv  *server.Server
}

func startServer(t testing.TB) *testServer { return startServerWith(t, func(*server.Options) {}) }

// startServerWith starts a server after secure has set its authentication.
func startServerWith(t testing.TB, secure func(*server.Options)) *testServer {
	t.Helper()
	s := &testServer{opts: &server.Options{
		Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(), NoSigs: true, NoLog: true,
	}}
	secure(s.opts)
	s.start(t)
	t.Cleanup(s.stop)
	return s
}

func (s *testServer) start(t testing.TB) {
	t.Helper()
	srv, err := server.NewServer(s.opts)
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	// A restart binds the same port, so the source finds it again.
	s.opts.Port = srv.Addr().(*net.TCPAddr).Port
	s.srv = srv
}

func (s *testServer) stop() {
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
}

func (s *testServer) url() string { return s.srv.ClientURL() }

// js connects a plain client, for the stream and the consumer's state.
func (s *testServer) js(t testing.TB) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(s.url())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

func (s *testServer) createStream(t testing.TB) {
	t.Helper()
	_, err := s.js(t).CreateStream(context.Background(), jetstream.StreamConfig{Name: testStream, Subjects: []string{"in.>"}})
	if err != nil {
		t.Fatal(err)
	}
}

// event is a message as the outbox's NATS sink publishes it; no id leaves
// ce-id out.
type event struct{ id, aggregate string }

func publish(t testing.TB, js jetstream.JetStream, events ...event) {
	t.Helper()
	for _, e := range events {
		h := nats.Header{}
		h.Set("ce-specversion", "1.0")
		h.Set("ce-source", "order")
		h.Set("ce-subject", e.aggregate)
		h.Set("ce-type", "order.updated")
		h.Set("content-type", "application/json")
		if e.id != "" {
			h.Set("ce-id", e.id)
		}
		body := fmt.Sprintf(`{"id": %q, "aggregate": %q}`, e.id, e.aggregate)
		if _, err := js.PublishMsg(context.Background(), &nats.Msg{Subject: testSubject, Header: h, Data: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
}

// events returns n events over aggs aggregates, with ids prefix-0, prefix-1, ...
func events(prefix string, n, aggs int) []event {
	out := make([]event, n)
	for i := range out {
		out[i] = event{id: fmt.Sprintf("%s-%d", prefix, i), aggregate: fmt.Sprintf("agg-%d", i%aggs)}
	}
	return out
}

// seenSQL is the test's work: one row per message processed, in order.
const seenSQL = `INSERT INTO seen (id, order_key) VALUES (@id, @order_key)`

// fixture is one test's inbox: a database, a consumer with the sql
// handler and the NATS source in front of it.
type fixture struct {
	t      testing.TB
	db     *pgtest.DB
	srv    *testServer
	src    inbox.SourceConfig
	cfg    inbox.Config
	states *states
}

func newFixture(t testing.TB, srv *testServer) *fixture {
	t.Helper()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE seen (n bigserial, id text NOT NULL, order_key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg := inbox.DefaultConfig()
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 100*time.Millisecond
	cfg.ProbeBackoffMax = 200 * time.Millisecond
	src := inbox.DefaultSource()
	src.Name, src.Kind = "orders", inbox.KindNATS
	src.Handler = inbox.HandlerConfig{Kind: inbox.HandlerSQL, SQL: seenSQL}
	src.NATS.URL, src.NATS.Stream, src.NATS.Consumer = srv.url(), testStream, "inbox"
	src.NATS.CreateConsumer, src.NATS.AckWait = true, 2*time.Second
	src.NATS.ConnectTimeout = 2 * time.Second
	return &fixture{t: t, db: db, srv: srv, src: src, cfg: cfg, states: &states{}}
}

// consumer returns an inbox consumer of the fixture's source with handler
// h (the sql handler when nil).
func (f *fixture) consumer(h inbox.Handler) *inbox.Consumer {
	if h == nil {
		h = inbox.SQLHandler{SQL: f.src.Handler.SQL}
	}
	m, err := inbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		f.t.Fatal(err)
	}
	log := (&testkit.LogBuffer{}).Logger()
	return inbox.NewConsumer(f.db.Pool, f.src, f.cfg, h, "test-replica", log, m)
}

// run starts the source in front of h until the test ends, reporting the
// source's state changes to f.states. It returns a stop function that
// waits for Run and returns its error.
func (f *fixture) run(h inbox.Handoff) (stop func() error) {
	f.t.Helper()
	s, err := New(f.src, f.cfg, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	return runSource(f.t, s, &reporting{Handoff: h, states: f.states})
}

func runSource(t testing.TB, s inbox.Source, h inbox.Handoff) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx, h) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-errc:
			case <-time.After(30 * time.Second):
				runErr = fmt.Errorf("Run did not return within 30s of its context ending")
			}
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return stop
}

// states records the source's Up and Down reports in order.
type states struct {
	mu   sync.Mutex
	seen []string
}

func (s *states) add(v string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.seen) == 0 || s.seen[len(s.seen)-1] != v {
		s.seen = append(s.seen, v)
	}
}

func (s *states) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprint(s.seen)
}

// reporting passes a Handoff's calls on, recording Up and Down.
type reporting struct {
	inbox.Handoff
	states *states
}

func (r *reporting) Up() {
	r.states.add("up")
	r.Handoff.Up()
}

func (r *reporting) Down(err error) {
	r.states.add("down")
	r.Handoff.Down(err)
}

// counts returns how many times each id's work ran.
func (f *fixture) counts() map[string]int {
	f.t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT id, count(*) FROM seen GROUP BY id`)
	if err != nil {
		f.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			f.t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		f.t.Fatal(err)
	}
	return out
}

func (f *fixture) scalar(sql string, args ...any) int {
	f.t.Helper()
	var n int
	if err := f.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// waitDone waits until n messages are finished in the inbox.
func (f *fixture) waitDone(n int) {
	f.t.Helper()
	testkit.Eventually(f.t, 30*time.Second, fmt.Sprintf("%d messages finished in the inbox", n), func() bool {
		return f.scalar(`SELECT count(*) FROM inbox_message WHERE state IN ('PROCESSED', 'DEAD')`) >= n
	})
}

// exactlyOnce checks that every id of evs ran exactly once.
func (f *fixture) exactlyOnce(evs []event) {
	f.t.Helper()
	counts := f.counts()
	for _, e := range evs {
		if counts[e.id] != 1 {
			f.t.Errorf("message %s processed %d times, want 1", e.id, counts[e.id])
		}
	}
	if len(counts) != len(evs) {
		f.t.Errorf("%d ids processed, want %d", len(counts), len(evs))
	}
}

// consumerInfo reads the durable consumer's state from the server.
func (f *fixture) consumerInfo(js jetstream.JetStream) *jetstream.ConsumerInfo {
	f.t.Helper()
	info, err := js.Consumer(context.Background(), testStream, f.src.NATS.Consumer)
	if err != nil {
		f.t.Fatal(err)
	}
	return info.CachedInfo()
}

// waitAcked waits until the consumer has acknowledged every message of
// the stream.
func (f *fixture) waitAcked(js jetstream.JetStream) {
	f.t.Helper()
	testkit.Eventually(f.t, 30*time.Second, "every message acknowledged", func() bool {
		c, err := js.Consumer(context.Background(), testStream, f.src.NATS.Consumer)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			return false // the source has not created it yet
		} else if err != nil {
			f.t.Fatal(err)
		}
		st, err := js.Stream(context.Background(), testStream)
		if err != nil {
			f.t.Fatal(err)
		}
		info := c.CachedInfo()
		return info.AckFloor.Stream >= st.CachedInfo().State.LastSeq && info.NumAckPending == 0
	})
}
