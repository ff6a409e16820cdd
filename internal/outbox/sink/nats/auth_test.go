package nats

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// secured is an in-process server that requires one kind of
// authentication, with the sink settings that pass it and some that fail.
type secured struct {
	right    outboxconfig.NATSConfig
	wrong    map[string]outboxconfig.NATSConfig // a credential the server refuses, by what is wrong
	badFiles []badFile                          // files the sink cannot use
	reader   []nats.Option                      // how a plain client gets in, to read the stream back
	secrets  []string                           // what must never be logged or returned
}

// badFile is a setting naming a file the sink cannot use.
type badFile struct {
	what, key string
	cfg       outboxconfig.NATSConfig
}

// TestAuthentication: every authentication method of outbox.nats against
// a server that requires it. The right credential connects and publishes
// an event the stream holds; a wrong one is refused on the first attempt
// (broker.ErrRefused, exit 77), and a file the sink cannot use, or a server
// certificate it does not trust, stops it (broker.ErrSetup naming the key,
// exit 78). No secret
// reaches the log or the error.
func TestAuthentication(t *testing.T) {
	t.Parallel()
	for name, setup := range map[string]func(t *testing.T) secured{
		"user and password":           userPasswordServer,
		"token":                       tokenServer,
		"nkey seed file":              nkeyServer,
		"creds file":                  credsServer,
		"tls with a private CA":       tlsServer,
		"tls with client certificate": mutualTLSServer,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			srv := setup(t)
			t.Run("right credential publishes", func(t *testing.T) {
				t.Parallel()
				logs := &testkit.LogBuffer{}
				s, err := New(srv.right, Options{Name: t.Name(), Logger: logs.Logger()})
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(t.Context(), srv.right.ConnectTimeout)
				defer cancel()
				if err := s.Connect(ctx); err != nil {
					t.Fatal(err)
				}
				defer s.Close(ctx)
				e := sinktest.Event("auth", 1)
				if err := s.Publish(ctx, e); err != nil {
					t.Fatal(err)
				}
				sinktest.CheckMessage(t, readFirst(t, srv.right, srv.reader), e)
				noSecrets(t, srv.secrets, logs.String())
			})
			for what, cfg := range srv.wrong {
				t.Run(what+" is refused at once", func(t *testing.T) {
					t.Parallel()
					logs := &testkit.LogBuffer{}
					s, err := New(cfg, Options{Name: t.Name(), Logger: logs.Logger()})
					if err != nil {
						t.Fatal(err)
					}
					// Retrying would end in ErrUnreachable when ctx ends.
					ctx, cancel := context.WithTimeout(t.Context(), cfg.ConnectTimeout)
					defer cancel()
					err = s.Connect(ctx)
					if !errors.Is(err, broker.ErrRefused) {
						t.Fatalf("got %v, want %v", err, broker.ErrRefused)
					}
					if retries := logs.Lines(t, "nats not ready yet"); len(retries) > 0 {
						t.Errorf("retried a refusal: %v", retries)
					}
					noSecrets(t, srv.secrets, logs.String(), err.Error())
				})
			}
			for _, f := range srv.badFiles {
				t.Run(f.what+" stops the start", func(t *testing.T) {
					t.Parallel()
					s, err := New(f.cfg, Options{Name: t.Name()})
					if err != nil {
						t.Fatal(err)
					}
					ctx, cancel := context.WithTimeout(t.Context(), f.cfg.ConnectTimeout)
					defer cancel()
					err = s.Connect(ctx)
					if !errors.Is(err, broker.ErrSetup) || !strings.Contains(err.Error(), f.key) {
						t.Fatalf("got %v, want %v naming %s", err, broker.ErrSetup, f.key)
					}
					noSecrets(t, srv.secrets, err.Error())
				})
			}
		})
	}
}

// readFirst returns the first message of cfg's stream, read by a plain
// client that gets in with opts.
func readFirst(t *testing.T, cfg outboxconfig.NATSConfig, opts []nats.Option) sinktest.Message {
	t.Helper()
	nc, err := nats.Connect(cfg.URL, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(t.Context(), cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetMsg(t.Context(), 1)
	if err != nil {
		t.Fatal(err)
	}
	return message(m.Header, m.Data)
}

func noSecrets(t *testing.T, secrets []string, texts ...string) {
	t.Helper()
	for _, text := range texts {
		for _, secret := range secrets {
			if strings.Contains(text, secret) {
				t.Errorf("a secret (%.6s...) is in %q", secret, text)
			}
		}
	}
}

// startSecured starts an in-process server with JetStream after secure has
// set its authentication, and returns the sink settings for it, without
// credentials; the sink creates the stream.
func startSecured(t *testing.T, secure func(*server.Options)) outboxconfig.NATSConfig {
	t.Helper()
	opts := &server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(), NoSigs: true, NoLog: true}
	secure(opts)
	s := &testServer{opts: opts}
	s.start(t)
	t.Cleanup(s.stop)
	c := outboxconfig.DefaultNATSConfig()
	c.URL = s.url()
	c.Stream, c.SubjectPrefix = "A"+uuid.NewString()[:8], "a"+uuid.NewString()[:8]
	c.CreateStream = true
	c.ConnectTimeout = 10 * time.Second
	c.PublishTimeout = 2 * time.Second
	return c
}

func userPasswordServer(t *testing.T) secured {
	c := startSecured(t, func(o *server.Options) { o.Username, o.Password = testUser, testPassword })
	right, wrongPassword, wrongUser := c, c, c
	right.User, right.Password = testUser, testPassword
	wrongPassword.User, wrongPassword.Password = testUser, "wrong-"+testPassword
	wrongUser.User, wrongUser.Password = "someone", testPassword
	return secured{
		right:   right,
		wrong:   map[string]outboxconfig.NATSConfig{"wrong password": wrongPassword, "unknown user": wrongUser},
		reader:  []nats.Option{nats.UserInfo(testUser, testPassword)},
		secrets: []string{testPassword},
	}
}

func tokenServer(t *testing.T) secured {
	const token = "tok-3b9e61d0-never-in-logs"
	c := startSecured(t, func(o *server.Options) { o.Authorization = token })
	right, wrong := c, c
	right.Token = token
	wrong.Token = "wrong-" + token
	return secured{
		right:   right,
		wrong:   map[string]outboxconfig.NATSConfig{"wrong token": wrong},
		reader:  []nats.Option{nats.Token(token)},
		secrets: []string{token},
	}
}

func nkeyServer(t *testing.T) secured {
	user, userSeed := newKey(t, nkeys.CreateUser)
	_, otherSeed := newKey(t, nkeys.CreateUser)
	pub, err := user.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	c := startSecured(t, func(o *server.Options) { o.Nkeys = []*server.NkeyUser{{Nkey: pub}} })
	right, wrong, missing := c, c, c
	right.NKeySeedFile = writeFile(t, "user.nk", userSeed)
	wrong.NKeySeedFile = writeFile(t, "other.nk", otherSeed)
	missing.NKeySeedFile = filepath.Join(t.TempDir(), "missing.nk")
	reader, err := nats.NkeyOptionFromSeed(right.NKeySeedFile)
	if err != nil {
		t.Fatal(err)
	}
	return secured{
		right:    right,
		wrong:    map[string]outboxconfig.NATSConfig{"another user's seed": wrong},
		badFiles: []badFile{{"a missing seed file", "outbox.nats.nkey_seed_file", missing}},
		reader:   []nats.Option{reader},
		secrets:  []string{userSeed, otherSeed},
	}
}

// credsServer runs in operator mode with a memory resolver: an operator,
// a system account, and an account with JetStream whose user the creds
// file holds. The wrong creds file is a user of an account the server
// does not know.
func credsServer(t *testing.T) secured {
	operator, _ := newKey(t, nkeys.CreateOperator)
	opPub, err := operator.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	opClaims, err := jwt.DecodeOperatorClaims(encode(t, jwt.NewOperatorClaims(opPub), operator))
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	_, sysPub := storeAccount(t, operator, resolver, false)
	account, _ := storeAccount(t, operator, resolver, true)
	stranger, _ := newKey(t, nkeys.CreateAccount) // not in the resolver

	c := startSecured(t, func(o *server.Options) {
		o.TrustedOperators = []*jwt.OperatorClaims{opClaims}
		o.AccountResolver = resolver
		o.SystemAccount = sysPub
	})
	rightCreds, rightSecrets := userCreds(t, account)
	wrongCreds, wrongSecrets := userCreds(t, stranger)
	right, wrong, missing, noSeed := c, c, c, c
	right.CredsFile = writeFile(t, "user.creds", rightCreds)
	wrong.CredsFile = writeFile(t, "stranger.creds", wrongCreds)
	missing.CredsFile = filepath.Join(t.TempDir(), "missing.creds")
	noSeed.CredsFile = writeFile(t, "jwt-only.creds", rightSecrets[0])
	return secured{
		right: right,
		wrong: map[string]outboxconfig.NATSConfig{"a user of an unknown account": wrong},
		badFiles: []badFile{
			{"a missing creds file", "outbox.nats.creds_file", missing},
			{"a creds file without a seed", "outbox.nats.creds_file", noSeed},
		},
		reader:  []nats.Option{nats.UserCredentials(right.CredsFile)},
		secrets: append(rightSecrets, wrongSecrets...),
	}
}

// storeAccount creates an account signed by operator and stores its JWT
// in resolver.
func storeAccount(t *testing.T, operator nkeys.KeyPair, resolver *server.MemAccResolver, jetStream bool) (kp nkeys.KeyPair, pub string) {
	t.Helper()
	kp, _ = newKey(t, nkeys.CreateAccount)
	pub, err := kp.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	claims := jwt.NewAccountClaims(pub)
	if jetStream {
		claims.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	}
	if err := resolver.Store(pub, encode(t, claims, operator)); err != nil {
		t.Fatal(err)
	}
	return kp, pub
}

// userCreds returns a creds file's contents for a new user of account, and
// the secrets in it: the user JWT and seed.
func userCreds(t *testing.T, account nkeys.KeyPair) (string, []string) {
	t.Helper()
	user, seed := newKey(t, nkeys.CreateUser)
	pub, err := user.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	userJWT := encode(t, jwt.NewUserClaims(pub), account)
	creds, err := jwt.FormatUserConfig(userJWT, []byte(seed))
	if err != nil {
		t.Fatal(err)
	}
	return string(creds), []string{userJWT, seed}
}

func encode(t *testing.T, claims jwt.Claims, signer nkeys.KeyPair) string {
	t.Helper()
	s, err := claims.Encode(signer)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func newKey(t *testing.T, create func() (nkeys.KeyPair, error)) (nkeys.KeyPair, string) {
	t.Helper()
	kp, err := create()
	if err != nil {
		t.Fatal(err)
	}
	seed, err := kp.Seed()
	if err != nil {
		t.Fatal(err)
	}
	return kp, string(seed)
}

// tlsServer requires TLS with a certificate from a throwaway CA. The sink
// trusts that CA through tls_ca_file; a CA that did not sign it is refused.
func tlsServer(t *testing.T) secured {
	dir := t.TempDir()
	ca, other := testkit.NewCA(t, dir, "ca"), testkit.NewCA(t, dir, "other-ca")
	srv := ca.Issue(t, "server", x509.ExtKeyUsageServerAuth)
	c := startSecured(t, func(o *server.Options) {
		o.TLSConfig = tlsConfig(t, &server.TLSConfigOpts{CertFile: srv.CertFile, KeyFile: srv.KeyFile})
	})
	c.URL = strings.Replace(c.URL, "nats://", "tls://", 1)
	right, untrusted, missing := c, c, c
	right.TLSCAFile = ca.File
	untrusted.TLSCAFile = other.File
	missing.TLSCAFile = filepath.Join(t.TempDir(), "missing.pem")
	return secured{
		right: right,
		badFiles: []badFile{
			{"a missing CA file", "outbox.nats.tls_ca_file", missing},
			// Retrying cannot make the server's certificate trusted.
			{"a server certificate not signed by tls_ca_file", "outbox.nats.tls_ca_file", untrusted},
		},
		reader: []nats.Option{nats.RootCAs(ca.File)},
	}
}

// mutualTLSServer verifies client certificates against its CA: the sink's
// tls_cert_file/tls_key_file pass, no client certificate or one from
// another CA does not.
func mutualTLSServer(t *testing.T) secured {
	dir := t.TempDir()
	ca, other := testkit.NewCA(t, dir, "ca"), testkit.NewCA(t, dir, "other-ca")
	srv := ca.Issue(t, "server", x509.ExtKeyUsageServerAuth)
	c := startSecured(t, func(o *server.Options) {
		o.TLSConfig = tlsConfig(t, &server.TLSConfigOpts{CertFile: srv.CertFile, KeyFile: srv.KeyFile, CaFile: ca.File, Verify: true})
		o.TLSVerify = true
	})
	c.URL = strings.Replace(c.URL, "nats://", "tls://", 1)
	c.TLSCAFile = ca.File
	relay, outsider := ca.Issue(t, "relay", x509.ExtKeyUsageClientAuth), other.Issue(t, "outsider", x509.ExtKeyUsageClientAuth)
	right, none, stranger, mismatched := c, c, c, c
	right.TLSCertFile, right.TLSKeyFile = relay.CertFile, relay.KeyFile
	stranger.TLSCertFile, stranger.TLSKeyFile = outsider.CertFile, outsider.KeyFile
	mismatched.TLSCertFile, mismatched.TLSKeyFile = right.TLSCertFile, stranger.TLSKeyFile
	return secured{
		right: right,
		wrong: map[string]outboxconfig.NATSConfig{
			"no client certificate":                none,
			"a client certificate from another CA": stranger,
		},
		badFiles: []badFile{{"a key that does not match the certificate", "outbox.nats.tls_cert_file", mismatched}},
		reader:   []nats.Option{nats.RootCAs(ca.File), nats.ClientCert(right.TLSCertFile, right.TLSKeyFile)},
		secrets:  []string{keyText(t, right.TLSKeyFile), keyText(t, stranger.TLSKeyFile)},
	}
}

func tlsConfig(t *testing.T, o *server.TLSConfigOpts) *tls.Config {
	t.Helper()
	c, err := server.GenTLSConfig(o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// writeFile writes contents to a new file in a temporary directory of its
// own (names repeat across calls) and returns its path.
func writeFile(t *testing.T, name, contents string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(contents), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// keyText is the first line of a PEM key file's base64 text: a part of the
// key that must not leak.
func keyText(t *testing.T, path string) string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(string(raw), "\n")[1]
}
