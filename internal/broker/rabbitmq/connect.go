package rabbitmq

import (
	"crypto/tls"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
)

// TLS returns the TLS configuration of a connection to uri, nil for
// amqp://. section is the configuration key and shownURL the URL without
// credentials, for errors.
func TLS(section string, uri amqp.URI, shownURL, caFile, certFile, keyFile string) (*tls.Config, error) {
	if uri.Scheme != "amqps" {
		if caFile != "" || certFile != "" {
			// The client speaks TLS only to an amqps:// URL: the files would
			// be ignored, and the connection left in plain text.
			return nil, fmt.Errorf("%s.tls_ca_file and tls_cert_file need an amqps:// %s.url, not %q", section, section, shownURL)
		}
		return nil, nil
	}
	return broker.TLSConfig(section, caFile, certFile, keyFile)
}

// DialError sorts a failed dial: the broker refusing the credentials or
// the virtual host (broker.ErrRefused), a TLS verdict (see
// broker.TLSVerdict), or else an error worth retrying. Each names the
// broker as shownURL.
func DialError(section, shownURL string, err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) && (ae.Code == amqp.AccessRefused || ae.Code == amqp.NotAllowed) {
		return fmt.Errorf("%w: rabbitmq %s: %s", broker.ErrRefused, shownURL, ae.Reason)
	}
	if verdict := broker.TLSVerdict(section, err); verdict != nil {
		return fmt.Errorf("rabbitmq %s: %w", shownURL, verdict)
	}
	return fmt.Errorf("rabbitmq %s: %w", shownURL, err)
}
