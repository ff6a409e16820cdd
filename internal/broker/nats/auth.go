package nats

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/worker-dev/worker/internal/broker"
)

// Auth is how a connection authenticates: at most one of user (with
// password), token, creds file and nkey seed file, and the TLS files. The
// outbox's sink (outbox.nats) and the inbox's NATS sources
// (inbox.sources[<name>].nats) both connect with it.
type Auth struct {
	User, Password, Token   string
	CredsFile, NKeySeedFile string
	TLSCAFile               string
	TLSCertFile, TLSKeyFile string
}

// AuthOptions returns the client options for a. It reads every file once,
// so that an unusable one stops the start instead of passing for an
// unreachable server (the client reads them again at every connect); its
// errors name the key under section (section.creds_file, ...) and the
// problem, never a file's contents.
func AuthOptions(section string, a Auth) ([]nats.Option, error) {
	var opts []nats.Option
	switch {
	case a.User != "":
		opts = append(opts, nats.UserInfo(a.User, a.Password))
	case a.Token != "":
		opts = append(opts, nats.Token(a.Token))
	case a.CredsFile != "":
		if err := checkCreds(a.CredsFile); err != nil {
			return nil, fmt.Errorf("%s.creds_file=%q: %w", section, a.CredsFile, err)
		}
		opts = append(opts, nats.UserCredentials(a.CredsFile))
	case a.NKeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(a.NKeySeedFile)
		if err != nil {
			// The library's text never quotes the seed, only the file.
			return nil, fmt.Errorf("%s.nkey_seed_file=%q: %w", section, a.NKeySeedFile, err)
		}
		opts = append(opts, o)
	}
	if _, err := broker.TLSConfig(section, a.TLSCAFile, a.TLSCertFile, a.TLSKeyFile); err != nil {
		return nil, err
	}
	if a.TLSCAFile != "" {
		opts = append(opts, nats.RootCAs(a.TLSCAFile))
	}
	if a.TLSCertFile != "" {
		opts = append(opts, nats.ClientCert(a.TLSCertFile, a.TLSKeyFile))
	}
	return opts, nil
}

// checkCreds reads the creds file once and checks that it holds a user
// seed. The errors name the problem, never the contents.
func checkCreds(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	defer clear(raw)
	kp, err := nkeys.ParseDecoratedUserNKey(raw)
	if err != nil {
		return err
	}
	kp.Wipe()
	return nil
}

// ConnectVerdict sorts a failed connect: a TLS verdict (see
// broker.TLSVerdict), or the server refusing the credentials or the
// handshake (broker.ErrRefused), both naming the server as shownURL; nil
// for anything else, which may pass with a retry. section is the
// configuration key, for errors.
func ConnectVerdict(section, shownURL string, err error) error {
	if verdict := broker.TLSVerdict(section, err); verdict != nil {
		return fmt.Errorf("nats %s: %w", shownURL, verdict)
	}
	if refused(err) {
		return fmt.Errorf("%w: nats %s: %w", broker.ErrRefused, shownURL, err)
	}
	return nil
}

// refused reports whether a failed connect is the server refusing the
// credentials, or a TLS handshake that one side rejects: no retry changes
// either.
func refused(err error) bool {
	// Under TLS 1.3 the server checks the client certificate after the
	// client's side of the handshake is done, and may close the connection
	// before its alert is read; nats.go words that case so.
	return errors.Is(err, nats.ErrAuthorization) || // the server's -ERR matches it by text
		errors.Is(err, nats.ErrTLS) && strings.Contains(err.Error(), "closed by remote after TLS handshake")
}
