package kafka

import (
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/worker-dev/worker/internal/broker"
)

// Auth is how a client authenticates: a SASL mechanism (PLAIN,
// SCRAM-SHA-256, SCRAM-SHA-512, or none) with its user and password, and
// TLS. The outbox's sink (outbox.kafka) and the inbox's Kafka sources
// (inbox.sources[<name>].kafka) both connect with it.
type Auth struct {
	SASLMechanism, SASLUser, SASLPassword string
	// TLS turns TLS on with the system's roots; a CA or client
	// certificate file turns it on too.
	TLS                     bool
	TLSCAFile               string
	TLSCertFile, TLSKeyFile string
}

// AuthOptions returns the client options for a. The TLS files are read
// here, so that an unusable one stops the start; the errors name the key
// under section (section.tls_ca_file, ...).
func AuthOptions(section string, a Auth) ([]kgo.Opt, error) {
	var opts []kgo.Opt
	if m := Mechanism(a.SASLMechanism, a.SASLUser, a.SASLPassword); m != nil {
		opts = append(opts, kgo.SASL(m))
	}
	if a.TLS || a.TLSCAFile != "" || a.TLSCertFile != "" {
		tc, err := broker.TLSConfig(section, a.TLSCAFile, a.TLSCertFile, a.TLSKeyFile)
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.DialTLSConfig(tc))
	}
	return opts, nil
}

// Mechanism returns the SASL mechanism called name for user and password,
// or nil for none (an empty or unknown name).
func Mechanism(name, user, password string) sasl.Mechanism {
	switch name {
	case "PLAIN":
		return plain.Auth{User: user, Pass: password}.AsMechanism()
	case "SCRAM-SHA-256":
		return scram.Auth{User: user, Pass: password}.AsSha256Mechanism()
	case "SCRAM-SHA-512":
		return scram.Auth{User: user, Pass: password}.AsSha512Mechanism()
	}
	return nil
}

// ConnectVerdict sorts an error of a client that asked the brokers
// something: a TLS verdict (see broker.TLSVerdict), credentials or
// authorisation refused (broker.ErrRefused), a SASL mechanism the brokers
// do not offer (broker.ErrSetup naming section.sasl_mechanism); nil for
// anything else, the brokers' trouble, which may pass with a retry.
// brokers names them in errors.
func ConnectVerdict(section, brokers, mechanism string, err error) error {
	if verdict := broker.TLSVerdict(section, err); verdict != nil {
		return fmt.Errorf("kafka %s: %w", brokers, verdict)
	}
	for _, refused := range []error{kerr.SaslAuthenticationFailed, kerr.ClusterAuthorizationFailed,
		kerr.GroupAuthorizationFailed, kerr.TopicAuthorizationFailed} {
		if errors.Is(err, refused) {
			return fmt.Errorf("%w: kafka %s: %w", broker.ErrRefused, brokers, err)
		}
	}
	if errors.Is(err, kerr.UnsupportedSaslMechanism) {
		return fmt.Errorf("%w: kafka %s: %s.sasl_mechanism=%s is not enabled on the broker: %w",
			broker.ErrSetup, brokers, section, mechanism, err)
	}
	return nil
}
