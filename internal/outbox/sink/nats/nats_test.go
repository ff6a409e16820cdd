package nats

import (
	"context"
	"errors"
	"net"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/worker-dev/worker/internal/broker"
	natsbroker "github.com/worker-dev/worker/internal/broker/nats"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// externalEnv names a NATS server with JetStream to test against instead
// of the in-process one (for example nats://127.0.0.1:4222). Stopping the
// broker still happens on an in-process server.
const externalEnv = "WORKER_TEST_NATS_URL"

// Child process settings of TestRelays.
const (
	childURLEnv    = "WORKER_SINKTEST_NATS_URL"
	childStreamEnv = "WORKER_SINKTEST_NATS_STREAM"
	childPrefixEnv = "WORKER_SINKTEST_NATS_PREFIX"
)

const testUser, testPassword = "relay", "pw-5f1c2a9e-never-in-errors"

// testServer is an in-process nats-server with JetStream.
type testServer struct {
	opts *server.Options
	srv  *server.Server
}

func startServer(t testing.TB, auth bool) *testServer {
	t.Helper()
	opts := &server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(), NoSigs: true, NoLog: true}
	if auth {
		opts.Username, opts.Password = testUser, testPassword
	}
	s := &testServer{opts: opts}
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
	// A restart binds the same port, so clients reconnect to it.
	s.opts.Port = srv.Addr().(*net.TCPAddr).Port
	s.srv = srv
}

func (s *testServer) stop() {
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
}

// restart stops the server and starts it again on the same port and store.
func (s *testServer) restart(t *testing.T) {
	s.stop()
	s.start(t)
}

func (s *testServer) url() string { return s.srv.ClientURL() }

// target is a broker for one test: a server URL and a stream of its own.
type target struct {
	url, user, password string
	stream, prefix      string
}

// newTarget returns a fresh stream on the external server if one is named,
// else on a new in-process server (with auth when asked).
func newTarget(t testing.TB, auth bool) (target, *testServer) {
	tg := target{stream: "T" + strings.ReplaceAll(uuid.NewString()[:8], "-", ""), prefix: "t" + uuid.NewString()[:8]}
	if u := os.Getenv(externalEnv); u != "" {
		tg.url = u
		return tg, nil
	}
	s := startServer(t, auth)
	tg.url = s.url()
	if auth {
		tg.user, tg.password = testUser, testPassword
	}
	return tg, s
}

func (tg target) config() outboxconfig.NATSConfig {
	c := outboxconfig.DefaultNATSConfig()
	c.URL, c.User, c.Password = tg.url, tg.user, tg.password
	c.Stream, c.SubjectPrefix = tg.stream, tg.prefix
	c.ConnectTimeout = 10 * time.Second
	c.PublishTimeout = 2 * time.Second
	return c
}

// js is a plain client of the target, for creating and reading the stream.
func (tg target) js(t testing.TB) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(tg.url, nats.UserInfo(tg.user, tg.password), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
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

// createStream creates the target's stream; maxMsgSize 0 means no limit.
func (tg target) createStream(t testing.TB, maxMsgSize int32) {
	t.Helper()
	_, err := tg.js(t).CreateStream(t.Context(), jetstream.StreamConfig{
		Name: tg.stream, Subjects: []string{tg.prefix + ".>"}, Duplicates: 2 * time.Minute, MaxMsgSize: maxMsgSize,
	})
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv(externalEnv) != "" {
		t.Cleanup(func() { _ = tg.js(t).DeleteStream(context.Background(), tg.stream) })
	}
}

// connect builds and connects a sink, closed when the test ends.
func connect(t testing.TB, cfg outboxconfig.NATSConfig) *Sink {
	t.Helper()
	s, err := New(cfg, Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), cfg.ConnectTimeout)
	defer cancel()
	if err := s.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s
}

// read returns every message of the target's stream, in stream order.
func (tg target) read(t *testing.T) []sinktest.Message {
	t.Helper()
	js := tg.js(t)
	st, err := js.Stream(t.Context(), tg.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(t.Context(), tg.stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []sinktest.Message
	for uint64(len(out)) < info.State.Msgs {
		batch, err := cons.Fetch(int(min(1000, info.State.Msgs-uint64(len(out)))), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := len(out)
		for m := range batch.Messages() {
			out = append(out, message(m.Headers(), m.Data()))
		}
		if len(out) == n {
			t.Fatalf("read %d of the stream's %d messages, then nothing more", n, info.State.Msgs)
		}
	}
	return out
}

// message decodes a JetStream message as a consumer would.
func message(h nats.Header, body []byte) sinktest.Message {
	m := sinktest.Message{ID: h.Get(jetstream.MsgIDHeader), Attrs: map[string]string{}, Headers: map[string]string{}, Body: body}
	for k, vs := range h {
		v := vs[0]
		switch {
		case strings.HasPrefix(k, "ce-"):
			dec, err := url.PathUnescape(v)
			if err != nil {
				dec = "undecodable: " + v
			}
			m.Attrs[strings.TrimPrefix(k, "ce-")] = dec
		case k == "content-type":
			m.Attrs["datacontenttype"] = v
		default:
			m.Headers[k] = v
		}
	}
	return m
}

func TestConformance(t *testing.T) {
	t.Parallel()
	tg, _ := newTarget(t, true)
	tg.createStream(t, 4096)
	sinktest.Exercise(t, sinktest.Broker{
		New:  func(t *testing.T) outbox.Sink { return connect(t, tg.config()) },
		Read: tg.read,
		Refused: func(*testing.T) outbox.Event {
			e := sinktest.Event("big", 0)
			e.Payload = []byte(`"` + strings.Repeat("x", 8192) + `"`) // over the stream's max_msg_size
			return e
		},
		Unreachable: func(t *testing.T, publishTimeout time.Duration) outbox.Sink {
			down, srv := newTargetInProcess(t)
			down.createStream(t, 0)
			cfg := down.config()
			cfg.PublishTimeout = publishTimeout
			s := connect(t, cfg)
			srv.stop()
			return s
		},
		Silent: func(t *testing.T, publishTimeout time.Duration) outbox.Sink {
			mute := muteTarget(t)
			cfg := mute.config()
			cfg.PublishTimeout = publishTimeout
			return connect(t, cfg)
		},
		Secret: testPassword,
	})
}

// newTargetInProcess is newTarget on an in-process server with auth, even
// when an external server is named: the test stops it.
func newTargetInProcess(t *testing.T) (target, *testServer) {
	s := startServer(t, true)
	return target{url: s.url(), user: testUser, password: testPassword,
		stream: "D" + uuid.NewString()[:8], prefix: "d" + uuid.NewString()[:8]}, s
}

// TestRelayProcess is the child relay process of TestRelays.
func TestRelayProcess(t *testing.T) {
	sinktest.RelayProcess(t, func(t *testing.T) outbox.Sink {
		tg := target{url: os.Getenv(childURLEnv), stream: os.Getenv(childStreamEnv), prefix: os.Getenv(childPrefixEnv)}
		return connect(t, tg.config())
	})
}

// TestRelays: 3 relays in 2 processes publish 20,000 events over 200
// aggregates; the child is SIGKILLed mid-batch and the server restarted
// mid-run. The stream holds every event exactly once: JetStream dropped
// the killed batch's redeliveries by Nats-Msg-Id.
func TestRelays(t *testing.T) {
	t.Parallel()
	tg, srv := newTarget(t, false)
	tg.createStream(t, 0)
	disrupt := func(t *testing.T) {
		if srv == nil {
			t.Logf("%s is set: the external server is not restarted", externalEnv)
			return
		}
		srv.restart(t)
	}
	sinktest.RelayRun(t, sinktest.Relays{
		Broker:     sinktest.Broker{New: func(t *testing.T) outbox.Sink { return connect(t, tg.config()) }, Read: tg.read},
		HelperTest: "TestRelayProcess",
		ChildEnv:   []string{childURLEnv + "=" + tg.url, childStreamEnv + "=" + tg.stream, childPrefixEnv + "=" + tg.prefix},
		Disrupt:    disrupt,
		Dedup:      true,
	})
}

func TestSubjectToken(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"Order":         "Order",
		"order.created": "order%2Ecreated",
		"a*b>c":         "a%2Ab%3Ec",
		"two words\t\n": "two%20words%09%0A",
		"50%":           "50%25",
		"naïve":         "na%C3%AFve",
		"":              "_",
		"$JS":           "%24JS",
		"_INBOX":        "%5FINBOX",
		"_":             "%5F",
		"a$b_c":         "a$b_c",
		"%24":           "%2524",
	} {
		if got := natsbroker.SubjectToken(in); got != want {
			t.Errorf("SubjectToken(%q) = %q, want %q", in, got, want)
		}
	}
	s, err := New(outboxconfig.DefaultNATSConfig(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	e := outbox.Event{AggregateType: "Sales Order", AggregateID: "a.b", EventType: "order.*"}
	if got, want := s.Subject(e), "outbox.Sales%20Order.order%2E%2A"; got != want {
		t.Errorf("subject %q, want %q", got, want)
	}
}

func TestNewRejectsBadSettings(t *testing.T) {
	t.Parallel()
	for key, change := range map[string]func(*outboxconfig.NATSConfig){
		"outbox.nats.subject_prefix": func(c *outboxconfig.NATSConfig) { c.SubjectPrefix = "a.*" },
		"outbox.nats.subject":        func(c *outboxconfig.NATSConfig) { c.Subject = "{prefix}.{nope}" },
		"outbox.nats.stream":         func(c *outboxconfig.NATSConfig) { c.Stream = "a.b" },
		"outbox.nats.user":           func(c *outboxconfig.NATSConfig) { c.Password = "x" },
	} {
		cfg := outboxconfig.DefaultNATSConfig()
		change(&cfg)
		if _, err := New(cfg, Options{}); err == nil || !strings.Contains(err.Error(), key) {
			t.Errorf("%s: got %v, want an error naming it", key, err)
		}
	}
}

func TestConnect(t *testing.T) {
	t.Parallel()
	tg, _ := newTargetInProcess(t)
	ctx := t.Context()

	t.Run("missing stream names the key", func(t *testing.T) {
		s, _ := New(tg.config(), Options{})
		err := s.Connect(ctx)
		if !errors.Is(err, broker.ErrSetup) || !strings.Contains(err.Error(), "outbox.nats.stream") || !strings.Contains(err.Error(), "create_stream") {
			t.Errorf("got %v", err)
		}
	})
	t.Run("wrong password is refused at once", func(t *testing.T) {
		cfg := tg.config()
		cfg.Password = "wrong-" + testPassword
		s, _ := New(cfg, Options{})
		err := s.Connect(ctx)
		if !errors.Is(err, broker.ErrRefused) || strings.Contains(err.Error(), cfg.Password) {
			t.Errorf("got %v", err)
		}
	})
	t.Run("unreachable until the budget ends", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close() // nothing listens there now
		cfg := tg.config()
		cfg.URL = "nats://" + testUser + ":" + testPassword + "@" + addr
		cfg.User, cfg.Password = "", ""
		s, _ := New(cfg, Options{})
		cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		err = s.Connect(cctx)
		if !errors.Is(err, broker.ErrUnreachable) || strings.Contains(err.Error(), testPassword) {
			t.Errorf("got %v", err)
		}
	})
	t.Run("create_stream, and a short duplicate window warns", func(t *testing.T) {
		cfg := tg.config()
		cfg.CreateStream = true
		logs := &testkit.LogBuffer{}
		s, err := New(cfg, Options{RedeliveryGap: time.Minute, Logger: logs.Logger()})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Connect(ctx); err != nil {
			t.Fatal(err)
		}
		defer s.Close(ctx)
		if err := s.Ready(ctx); err != nil {
			t.Errorf("ready: %v", err)
		}
		info, err := tg.js(t).Stream(ctx, tg.stream)
		if err != nil {
			t.Fatal(err)
		}
		if got := info.CachedInfo().Config.Subjects; len(got) != 1 || got[0] != tg.prefix+".*.*" {
			t.Errorf("created stream subjects %v", got)
		}
		if len(logs.Lines(t, "nats stream created")) != 1 {
			t.Errorf("no creation logged: %s", logs.String())
		}

		// The relay may redeliver after up to 10 minutes: the 2-minute
		// window is too short.
		s2, _ := New(cfg, Options{RedeliveryGap: 10 * time.Minute, Logger: logs.Logger()})
		if err := s2.Connect(ctx); err != nil {
			t.Fatal(err)
		}
		defer s2.Close(ctx)
		if len(logs.Lines(t, "nats stream duplicate window is shorter than the relay's longest redelivery gap: a late redelivery is stored twice; raise the stream's duplicate_window")) != 1 {
			t.Errorf("no warning: %s", logs.String())
		}
	})
}
