package startup_test

import (
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

const natsPassword = "nats-pw-77d1-never-logged"

// startNATS runs an in-process nats-server with JetStream and a password,
// keeping its streams in store.
func startNATS(t *testing.T, port int, store string) *server.Server {
	t.Helper()
	return runNATS(t, &server.Options{Port: port, StoreDir: store, Username: "relay", Password: natsPassword})
}

// runNATS runs an in-process nats-server with JetStream on 127.0.0.1, as o
// further sets it, until the test ends.
func runNATS(t *testing.T, o *server.Options) *server.Server {
	t.Helper()
	o.Host, o.JetStream, o.NoSigs, o.NoLog = "127.0.0.1", true, true, true
	s, err := server.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	return s
}

// The worker with the nats sink: publishes with its ack, creates the stream
// when asked, stays ready while the broker is away, rides out a broker
// restart, and never logs the password.
func TestNATSSinkWorker(t *testing.T) {
	t.Parallel()
	store := t.TempDir()
	srv := startNATS(t, server.RANDOM_PORT, store)
	port := srv.Addr().(*net.TCPAddr).Port
	db := pgtest.New(t)
	p := startWorker(t, []string{
		"APP_DATABASE_URL=" + db.URL,
		"APP_OUTBOX_SINK=nats",
		"APP_OUTBOX_NATS_URL=" + srv.ClientURL(),
		"APP_OUTBOX_NATS_USER=relay",
		"APP_OUTBOX_NATS_PASSWORD=" + natsPassword,
		"APP_OUTBOX_NATS_CREATE_STREAM=true",
		"APP_OUTBOX_MAX_ATTEMPTS=100",
		"APP_OUTBOX_BACKOFF_BASE=50ms",
		"APP_OUTBOX_BACKOFF_MAX=500ms",
	})
	p.waitReady(t, 20*time.Second)

	nc, err := nats.Connect(srv.ClientURL(), nats.UserInfo("relay", natsPassword), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	held := func() uint64 {
		st, err := js.Stream(t.Context(), "OUTBOX")
		if err != nil {
			return 0
		}
		info, err := st.Info(t.Context())
		if err != nil {
			return 0
		}
		return info.State.Msgs
	}
	insert := func(n int) {
		t.Helper()
		if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'order', 'o-' || g, 'order.paid', '{}' FROM generate_series(1, $1) g`, n); err != nil {
			t.Fatal(err)
		}
	}
	insert(10)
	testkit.Eventually(t, 20*time.Second, "10 events in the stream", func() bool { return held() == 10 })
	st, err := js.Stream(t.Context(), "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	msg, err := st.GetLastMsgForSubject(t.Context(), "outbox.order.order%2Epaid")
	if err != nil {
		t.Fatalf("no message on the escaped subject: %v", err)
	}
	if msg.Header.Get("Nats-Msg-Id") == "" || msg.Header.Get("Nats-Msg-Id") != msg.Header.Get("ce-id") {
		t.Errorf("headers %v", msg.Header)
	}

	srv.Shutdown()
	srv.WaitForShutdown()
	insert(5) // while the broker is away
	assertReadyThroughSinkOutage(t, p)
	srv = startNATS(t, port, store)
	p.waitReady(t, 20*time.Second)
	testkit.Eventually(t, 30*time.Second, "every event in the stream after the restart", func() bool { return held() == 15 })

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 20*time.Second); code != 0 {
		t.Errorf("exit %d after SIGTERM", code)
	}
	if strings.Contains(p.out.String(), natsPassword) {
		t.Error("the NATS password is in the worker's output")
	}
}

// A broker that stays unreachable exits 69 after connect_timeout, naming
// the knob and hiding the password; a missing stream, or a subject template
// whose first token an event could choose, exits 78 naming the key.
func TestNATSSinkStartFailures(t *testing.T) {
	t.Parallel()
	t.Run("unreachable", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=nats",
			"APP_OUTBOX_NATS_URL=nats://relay:" + natsPassword + "@" + addr, "APP_OUTBOX_NATS_CONNECT_TIMEOUT=1s"})
		if code := p.exitCode(t, 20*time.Second); code != 69 {
			t.Fatalf("exit %d, want 69", code)
		}
		out := p.out.String()
		if strings.Contains(out, natsPassword) || !strings.Contains(out, "APP_OUTBOX_NATS_CONNECT_TIMEOUT") {
			t.Errorf("want the knob named and no password:\n%s", out)
		}
	})
	t.Run("missing stream", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		srv := startNATS(t, server.RANDOM_PORT, t.TempDir())
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_URL=" + srv.ClientURL(),
			"APP_OUTBOX_NATS_USER=relay", "APP_OUTBOX_NATS_PASSWORD=" + natsPassword})
		if code := p.exitCode(t, 20*time.Second); code != 78 {
			t.Fatalf("exit %d, want 78", code)
		}
		if !strings.Contains(p.out.String(), "outbox.nats.stream") {
			t.Errorf("the key is not named:\n%s", p.out.String())
		}
	})
	t.Run("subject template reaching the server's subjects", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		srv := startNATS(t, server.RANDOM_PORT, t.TempDir())
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_URL=" + srv.ClientURL(),
			"APP_OUTBOX_NATS_USER=relay", "APP_OUTBOX_NATS_PASSWORD=" + natsPassword, "APP_OUTBOX_NATS_CREATE_STREAM=true",
			"APP_OUTBOX_NATS_SUBJECT={aggregate_type}.{aggregate_id}.{event_type}"})
		if code := p.exitCode(t, 20*time.Second); code != 78 {
			t.Fatalf("exit %d, want 78", code)
		}
		if out := p.out.String(); !strings.Contains(out, `APP_OUTBOX_NATS_SUBJECT=\"{aggregate_type}.{aggregate_id}.{event_type}\": the first token must be literal text`) {
			t.Errorf("want the key and the rule named:\n%s", out)
		}
	})
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		srv := startNATS(t, server.RANDOM_PORT, t.TempDir())
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_URL=" + srv.ClientURL(),
			"APP_OUTBOX_NATS_USER=relay", "APP_OUTBOX_NATS_PASSWORD=wrong-" + natsPassword})
		if code := p.exitCode(t, 20*time.Second); code != 77 {
			t.Fatalf("exit %d, want 77", code)
		}
		if strings.Contains(p.out.String(), natsPassword) {
			t.Errorf("password printed:\n%s", p.out.String())
		}
	})
}

// The rabbitmq sink at start: unreachable exits 69 naming the knob without
// the password, a missing exchange exits 78 naming the key. (The broker's
// own tests live in internal/outbox/sink/rabbitmq.)
func TestRabbitMQSinkStartFailures(t *testing.T) {
	t.Parallel()
	t.Run("unreachable", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=rabbitmq",
			"APP_OUTBOX_RABBITMQ_URL=amqp://app:amqp-pw-31@127.0.0.1:1/", "APP_OUTBOX_RABBITMQ_CONNECT_TIMEOUT=1s"})
		if code := p.exitCode(t, 20*time.Second); code != 69 {
			t.Fatalf("exit %d, want 69", code)
		}
		if out := p.out.String(); strings.Contains(out, "amqp-pw-31") || !strings.Contains(out, "APP_OUTBOX_RABBITMQ_CONNECT_TIMEOUT") {
			t.Errorf("want the knob named and no password:\n%s", out)
		}
	})
	t.Run("missing exchange", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		// The broker of the rabbitmq sink's tests, with their opt-out.
		testkit.SkipWithoutRabbitMQ(t)
		url := testkit.RabbitMQURL()
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=rabbitmq",
			"APP_OUTBOX_RABBITMQ_URL=" + url, "APP_OUTBOX_RABBITMQ_EXCHANGE=no-such-exchange-for-worker-tests"})
		if code := p.exitCode(t, 20*time.Second); code != 78 {
			t.Fatalf("exit %d, want 78 (is RabbitMQ running at %s? %s names another)", code, broker.RedactURLs(url), testkit.RabbitMQURLEnv)
		}
		if !strings.Contains(p.out.String(), "outbox.rabbitmq.exchange") {
			t.Errorf("the key is not named:\n%s", p.out.String())
		}
	})
}

// The rabbitmq sink's broker is not in /readyz: the worker stays ready
// after the relay has met the lost connection. The worker reaches the
// broker through a proxy, so the test can take it away from this worker
// alone.
func TestRabbitMQSinkReadiness(t *testing.T) {
	t.Parallel()
	testkit.SkipWithoutRabbitMQ(t)
	u := testkit.ParseRabbitMQURL(t)
	proxy := sinktest.NewProxy(t, u.Host)
	u.Host = proxy.Addr()
	db := pgtest.New(t)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=rabbitmq",
		"APP_OUTBOX_RABBITMQ_URL=" + u.String(), "APP_OUTBOX_RABBITMQ_EXCHANGE=amq.topic"})
	p.waitReady(t, 20*time.Second)
	proxy.Cut()
	if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('order', 'o-1', 'order.paid', '{}')`); err != nil {
		t.Fatal(err)
	}
	assertReadyThroughSinkOutage(t, p)
}

// The worker with the kafka sink: publishes with acks=all, stays ready
// while the brokers are away, and at start exits 69 naming the knob,
// without the SASL password, when no broker answers within
// connect_timeout.
func TestKafkaSinkWorker(t *testing.T) {
	t.Parallel()
	t.Run("publishes and stays ready without the broker", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "order"))
		if err != nil {
			t.Fatal(err)
		}
		defer cluster.Close()
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=kafka",
			"APP_OUTBOX_KAFKA_BROKERS=" + strings.Join(cluster.ListenAddrs(), ",")})
		p.waitReady(t, 20*time.Second)
		if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'order', 'o-' || g, 'order.paid', '{}' FROM generate_series(1, 10) g`); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 20*time.Second, "10 events acknowledged", func() bool {
			var n int
			_ = db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox_event_state WHERE status = 'PUBLISHED'`).Scan(&n)
			return n == 10
		})
		cluster.Close()
		if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', 'o-11', 'order.paid', '{}')`); err != nil {
			t.Fatal(err)
		}
		assertReadyThroughSinkOutage(t, p)
	})
	t.Run("unreachable", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_SINK=kafka",
			"APP_OUTBOX_KAFKA_BROKERS=127.0.0.1:1", "APP_OUTBOX_KAFKA_CONNECT_TIMEOUT=1s",
			"APP_OUTBOX_KAFKA_SASL_MECHANISM=PLAIN", "APP_OUTBOX_KAFKA_SASL_USER=relay", "APP_OUTBOX_KAFKA_SASL_PASSWORD=kafka-pw-52"})
		if code := p.exitCode(t, 20*time.Second); code != 69 {
			t.Fatalf("exit %d, want 69", code)
		}
		if out := p.out.String(); strings.Contains(out, "kafka-pw-52") || !strings.Contains(out, "APP_OUTBOX_KAFKA_CONNECT_TIMEOUT") {
			t.Errorf("want the knob named and no password:\n%s", out)
		}
	})
}
