package kafka

import (
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/worker-dev/worker/internal/outbox/sink"
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
		tc, err := sink.TLSConfig(section, a.TLSCAFile, a.TLSCertFile, a.TLSKeyFile)
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
