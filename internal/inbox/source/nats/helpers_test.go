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

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
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

// event is a message as the outbox's NATS sink publishes it; no ID leaves
// ce-id out.
type event = inboxtest.Event

func publish(t testing.TB, js jetstream.JetStream, events ...event) {
	t.Helper()
	for _, e := range events {
		h := nats.Header{}
		h.Set("ce-specversion", "1.0")
		h.Set("ce-source", "order")
		h.Set("ce-subject", e.Aggregate)
		h.Set("ce-type", "order.updated")
		h.Set("content-type", "application/json")
		if e.ID != "" {
			h.Set("ce-id", e.ID)
		}
		body := fmt.Sprintf(`{"id": %q, "aggregate": %q}`, e.ID, e.Aggregate)
		if _, err := js.PublishMsg(context.Background(), &nats.Msg{Subject: testSubject, Header: h, Data: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
}

// fixture is one test's inbox (see inboxtest.Fixture) with the NATS
// source in front of it.
type fixture struct {
	*inboxtest.Fixture
	srv  *testServer
	logs *testkit.LogBuffer // the source's own log
}

func newFixture(t testing.TB, srv *testServer) *fixture {
	t.Helper()
	f := &fixture{Fixture: inboxtest.NewFixture(t, inboxconfig.KindNATS), srv: srv, logs: &testkit.LogBuffer{}}
	f.Src.NATS.URL, f.Src.NATS.Stream, f.Src.NATS.Consumer = srv.url(), testStream, "inbox"
	f.Src.NATS.CreateConsumer, f.Src.NATS.AckWait = true, 2*time.Second
	f.Src.NATS.ConnectTimeout = 2 * time.Second
	return f
}

// run starts the source in front of h until the test ends, reporting the
// source's state changes to f.States. It returns a stop function that
// waits for Run and returns its error.
func (f *fixture) run(h inbox.Handoff) (stop func() error) {
	f.T.Helper()
	s, err := New(f.Src, f.Cfg, f.logs.Logger())
	if err != nil {
		f.T.Fatal(err)
	}
	return f.Run(s, h)
}

// consumerInfo reads the durable consumer's state from the server.
func (f *fixture) consumerInfo(js jetstream.JetStream) *jetstream.ConsumerInfo {
	f.T.Helper()
	info, err := js.Consumer(context.Background(), testStream, f.Src.NATS.Consumer)
	if err != nil {
		f.T.Fatal(err)
	}
	return info.CachedInfo()
}

// waitAcked waits until the consumer has acknowledged every message of
// the stream.
func (f *fixture) waitAcked(js jetstream.JetStream) {
	f.T.Helper()
	testkit.Eventually(f.T, 30*time.Second, "every message acknowledged", func() bool {
		c, err := js.Consumer(context.Background(), testStream, f.Src.NATS.Consumer)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			return false // the source has not created it yet
		} else if err != nil {
			f.T.Fatal(err)
		}
		st, err := js.Stream(context.Background(), testStream)
		if err != nil {
			f.T.Fatal(err)
		}
		info := c.CachedInfo()
		return info.AckFloor.Stream >= st.CachedInfo().State.LastSeq && info.NumAckPending == 0
	})
}

// proxy forwards TCP connections to a server, and can freeze: while
// frozen it forwards nothing either way and keeps every connection open,
// as a server stopped with SIGSTOP (or a network that drops packets)
// looks to its clients.
type proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	frozen bool
	thawed chan struct{} // closed when the proxy thaws
}

func startProxy(t testing.TB, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target, thawed: make(chan struct{})}
	close(p.thawed)
	var conns sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			open = append(open, c, s)
			mu.Unlock()
			conns.Add(2)
			go func() { defer conns.Done(); p.pipe(s, c) }()
			go func() { defer conns.Done(); p.pipe(c, s) }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		p.thaw()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		conns.Wait()
	})
	return p
}

func (p *proxy) url() string { return "nats://" + p.ln.Addr().String() }

// pipe copies from src to dst, holding each chunk while the proxy is
// frozen.
func (p *proxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			thawed := p.thawed
			p.mu.Unlock()
			<-thawed
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *proxy) freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.frozen {
		p.frozen, p.thawed = true, make(chan struct{})
	}
}

func (p *proxy) thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.frozen {
		p.frozen = false
		close(p.thawed)
	}
}
