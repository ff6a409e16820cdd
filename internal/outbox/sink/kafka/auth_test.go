package kafka

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/worker-dev/worker/internal/broker"
	kafkabroker "github.com/worker-dev/worker/internal/broker/kafka"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

const (
	// eventTopic is where a sinktest.Event goes with the topic template
	// {aggregate_type}: its aggregate type "Sales Order", escaped.
	eventTopic = "Sales_20Order"

	saslUser      = "relay"
	saslPassword  = "right-pass-7f3a"
	wrongPassword = "wrong-pass-c91e"
)

// secureCluster starts a kfake cluster of three brokers with opts and the
// topic of sinktest.Event, and returns it with its brokers.
func secureCluster(t *testing.T, opts ...kfake.Opt) (*kfake.Cluster, string) {
	t.Helper()
	c, err := kfake.NewCluster(append(opts, kfake.SeedTopics(partitions, eventTopic))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c, strings.Join(c.ListenAddrs(), ",")
}

func saslConfig(brokers, mechanism, password string) outboxconfig.KafkaConfig {
	cfg := config(brokers, "{aggregate_type}")
	cfg.SASLMechanism, cfg.SASLUser, cfg.SASLPassword = mechanism, saslUser, password
	return cfg
}

// sinkLog collects a sink's log lines unmasked: what the sink writes
// before the worker's logger hides the configured secrets. onRetry runs
// when the sink logs a failed connect attempt.
type sinkLog struct {
	bytes.Buffer
	onRetry func()
}

func (l *sinkLog) Write(p []byte) (int, error) {
	if l.onRetry != nil && bytes.Contains(p, []byte("kafka not ready yet")) {
		l.onRetry()
	}
	return l.Buffer.Write(p)
}

// loggedSink returns an unconnected sink for cfg and its log.
func loggedSink(t *testing.T, cfg outboxconfig.KafkaConfig) (*Sink, *sinkLog) {
	t.Helper()
	logs := &sinkLog{}
	s, err := New(cfg, Options{Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s, logs
}

// connectUntilRetry calls Connect with a budget that ends as soon as the
// sink has logged one failed attempt: the connect_timeout running out
// after that attempt, without waiting for a clock.
func connectUntilRetry(t *testing.T, s *Sink, logs *sinkLog) error {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	logs.onRetry = cancel
	return s.Connect(ctx)
}

// publishAndRead publishes one event through s; a consumer with opts must
// read it back with its id, CloudEvents headers, stored headers and body.
func publishAndRead(t *testing.T, s *Sink, brokers string, opts ...kgo.Opt) {
	t.Helper()
	e := sinktest.Event("a1", 0)
	if err := s.Publish(t.Context(), e); err != nil {
		t.Fatal(err)
	}
	got := read(t, brokers, eventTopic, opts...)
	if len(got) != 1 {
		t.Fatalf("read %d records, want 1", len(got))
	}
	sinktest.CheckMessage(t, got[0], e)
}

func noPassword(t *testing.T, what, text string) {
	t.Helper()
	for _, p := range []string{saslPassword, wrongPassword} {
		if strings.Contains(text, p) {
			t.Errorf("%s quotes a password: %s", what, text)
		}
	}
}

// refuseAsKafka makes c answer the SaslAuthenticate request that carries
// the password (PLAIN's only one, SCRAM's client-final message with its
// proof) as a Kafka broker answers a wrong one: error code
// SASL_AUTHENTICATION_FAILED with Kafka's message. kfake itself closes the
// connection there. The answer does not depend on the password: the tests
// send a wrong one.
func refuseAsKafka(c *kfake.Cluster, mechanism string) {
	c.ControlKey(int16(kmsg.SASLAuthenticate), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.SASLAuthenticateRequest)
		if mechanism != "PLAIN" && !bytes.Contains(req.SASLAuthBytes, []byte(",p=")) {
			return nil, nil, false // SCRAM's first message names the user: kfake answers it
		}
		c.KeepControl()
		resp := req.ResponseKind().(*kmsg.SASLAuthenticateResponse)
		resp.ErrorCode = kerr.SaslAuthenticationFailed.Code
		resp.ErrorMessage = kmsg.StringPtr("Authentication failed during authentication due to invalid credentials with SASL mechanism " + mechanism)
		return resp, nil, true
	})
}

// Each SASL mechanism against a cluster that requires it: the right
// password publishes, a wrong one fails, and the sink never writes either
// password into its errors or logs. (config print is covered by
// startup's TestSinkSecretsMasked.)
func TestSASL(t *testing.T) {
	t.Parallel()
	for _, mech := range []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} {
		t.Run(mech, func(t *testing.T) {
			t.Parallel()
			requireSASL := []kfake.Opt{kfake.EnableSASL(), kfake.Superuser(mech, saslUser, saslPassword)}

			t.Run("right password publishes", func(t *testing.T) {
				t.Parallel()
				_, brokers := secureCluster(t, requireSASL...)
				cfg := saslConfig(brokers, mech, saslPassword)
				s, logs := loggedSink(t, cfg)
				ctx, cancel := context.WithTimeout(t.Context(), cfg.ConnectTimeout)
				defer cancel()
				if err := s.Connect(ctx); err != nil {
					t.Fatal(err)
				}
				publishAndRead(t, s, brokers, kgo.SASL(kafkabroker.Mechanism(cfg.SASLMechanism, cfg.SASLUser, cfg.SASLPassword)))
				noPassword(t, "the log", logs.String())
			})

			// kfake closes the connection on a wrong password, which looks
			// like a broker going away: retried until the budget ends.
			t.Run("wrong password against kfake: unreachable", func(t *testing.T) {
				t.Parallel()
				_, brokers := secureCluster(t, requireSASL...)
				s, logs := loggedSink(t, saslConfig(brokers, mech, wrongPassword))
				err := connectUntilRetry(t, s, logs)
				if !errors.Is(err, broker.ErrUnreachable) || !strings.Contains(err.Error(), "EOF") {
					t.Fatalf("got %v, want %v with the closed connection", err, broker.ErrUnreachable)
				}
				noPassword(t, "the error", err.Error())
				noPassword(t, "the log", logs.String())
			})

			t.Run("wrong password refused as Kafka refuses it", func(t *testing.T) {
				t.Parallel()
				c, brokers := secureCluster(t, requireSASL...)
				refuseAsKafka(c, mech)
				cfg := saslConfig(brokers, mech, wrongPassword)
				s, logs := loggedSink(t, cfg)
				ctx, cancel := context.WithTimeout(t.Context(), cfg.ConnectTimeout)
				defer cancel()
				err := s.Connect(ctx)
				if !errors.Is(err, broker.ErrRefused) {
					t.Fatalf("got %v, want %v", err, broker.ErrRefused)
				}
				if strings.Contains(logs.String(), "kafka not ready yet") {
					t.Errorf("a refusal was retried:\n%s", logs)
				}
				if !strings.Contains(err.Error(), "invalid credentials with SASL mechanism "+mech) {
					t.Errorf("the broker's message is lost: %v", err)
				}
				noPassword(t, "the error", err.Error())
				noPassword(t, "the log", logs.String())
			})
		})
	}
}

// A mechanism the broker does not enable is a configuration error (exit
// 78, naming the key) at once, not a broker to wait for. kfake enables
// every mechanism it knows, so it is made to answer the handshake as a
// broker without SCRAM-SHA-512 does.
func TestSASLMechanismNotEnabled(t *testing.T) {
	t.Parallel()
	const mech = "SCRAM-SHA-512"
	c, brokers := secureCluster(t, kfake.EnableSASL(), kfake.Superuser(mech, saslUser, saslPassword))
	c.ControlKey(int16(kmsg.SASLHandshake), func(r kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		resp := r.ResponseKind().(*kmsg.SASLHandshakeResponse)
		resp.ErrorCode = kerr.UnsupportedSaslMechanism.Code
		resp.SupportedMechanisms = []string{"PLAIN"}
		return resp, nil, true
	})
	cfg := saslConfig(brokers, mech, saslPassword)
	s, logs := loggedSink(t, cfg)
	ctx, cancel := context.WithTimeout(t.Context(), cfg.ConnectTimeout)
	defer cancel()
	err := s.Connect(ctx)
	if !errors.Is(err, broker.ErrSetup) || !strings.Contains(err.Error(), "outbox.kafka.sasl_mechanism=SCRAM-SHA-512") {
		t.Fatalf("got %v, want %v naming outbox.kafka.sasl_mechanism", err, broker.ErrSetup)
	}
	if strings.Contains(logs.String(), "kafka not ready yet") {
		t.Errorf("a setup error was retried:\n%s", logs)
	}
}

// TLS against brokers listening with a certificate from a throwaway CA:
// tls_ca_file trusts it, another CA or the system's do not, and a broker
// that requires client certificates takes tls_cert_file/tls_key_file.
func TestTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca, otherCA := testkit.NewCA(t, dir, "ca"), testkit.NewCA(t, dir, "other-ca")
	serverCert := ca.Issue(t, "broker", x509.ExtKeyUsageServerAuth)
	client := ca.Issue(t, "client", x509.ExtKeyUsageClientAuth)
	consumerTLS := kgo.DialTLSConfig(&tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{client.TLS}})
	listen := func(clientAuth tls.ClientAuthType) kfake.Opt {
		return kfake.TLS(&tls.Config{
			Certificates: []tls.Certificate{serverCert.TLS}, ClientAuth: clientAuth, ClientCAs: ca.Pool(),
			MinVersion: tls.VersionTLS12,
		})
	}

	t.Run("tls_ca_file connects and publishes", func(t *testing.T) {
		t.Parallel()
		_, brokers := secureCluster(t, listen(tls.NoClientCert))
		cfg := config(brokers, "{aggregate_type}")
		cfg.TLSCAFile = ca.File // turns TLS on by itself
		publishAndRead(t, connect(t, cfg), brokers, consumerTLS)
	})

	// Retrying cannot make the broker's certificate trusted: a setup error
	// (exit 78) at once.
	t.Run("a CA that did not sign the broker's certificate fails", func(t *testing.T) {
		t.Parallel()
		_, brokers := secureCluster(t, listen(tls.NoClientCert))
		for name, trust := range map[string]func(*outboxconfig.KafkaConfig){
			"tls_ca_file of another CA": func(c *outboxconfig.KafkaConfig) { c.TLSCAFile = otherCA.File },
			"tls with the system's CAs": func(c *outboxconfig.KafkaConfig) { c.TLS = true },
		} {
			cfg := config(brokers, "{aggregate_type}")
			trust(&cfg)
			s, logs := loggedSink(t, cfg)
			err := connectUntilRetry(t, s, logs)
			if !errors.Is(err, broker.ErrSetup) || !strings.Contains(err.Error(), "certificate signed by unknown authority") ||
				!strings.Contains(err.Error(), "outbox.kafka.tls_ca_file") {
				t.Errorf("%s: got %v, want %v naming the unknown authority and outbox.kafka.tls_ca_file", name, err, broker.ErrSetup)
			}
			if strings.Contains(logs.String(), "kafka not ready yet") {
				t.Errorf("%s: retried:\n%s", name, logs)
			}
		}
	})

	t.Run("client certificate required", func(t *testing.T) {
		t.Parallel()
		_, brokers := secureCluster(t, listen(tls.RequireAndVerifyClientCert))
		cfg := config(brokers, "{aggregate_type}")
		cfg.TLSCAFile = ca.File
		s, logs := loggedSink(t, cfg)
		if err := connectUntilRetry(t, s, logs); !errors.Is(err, broker.ErrRefused) || !strings.Contains(err.Error(), "certificate required") {
			t.Errorf("without a client certificate: got %v, want %v naming the missing certificate", err, broker.ErrRefused)
		}
		cfg.TLSCertFile, cfg.TLSKeyFile = client.CertFile, client.KeyFile
		publishAndRead(t, connect(t, cfg), brokers, consumerTLS)
	})
}
