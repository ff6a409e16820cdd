package broker

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
)

// TLSConfig builds a client TLS configuration from the files of a sink's
// or a source's section: a CA bundle to trust (else the system's) and an
// optional client certificate. prefix is the section's key, for errors.
func TLSConfig(prefix, caFile, certFile, keyFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("%s.tls_ca_file: %w", prefix, err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s.tls_ca_file=%q: no PEM certificate in it", prefix, caFile)
		}
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("%s.tls_cert_file, %s.tls_key_file: %w", prefix, prefix, err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

// TLSVerdict tells a failed connect that TLS settled, and retrying cannot
// change, from one to retry. A broker certificate that does not verify
// (another CA, expired, another host) is ErrSetup naming the CA setting of
// section; a TLS alert from the broker means it rejected our client
// certificate (or its absence): ErrRefused. Any other error gives nil.
func TLSVerdict(section string, err error) error {
	var untrusted *tls.CertificateVerificationError
	var op *net.OpError
	switch {
	case errors.As(err, &untrusted):
		return fmt.Errorf("%w: %w; %s.tls_ca_file must hold the CA that signed the broker's certificate, for the host in the URL",
			ErrSetup, err, section)
	case errors.As(err, &op) && op.Op == "remote error": // crypto/tls's wording for an alert received
		return fmt.Errorf("%w: the broker ended the TLS handshake (%s.tls_cert_file: a client certificate it does not accept, or none): %w",
			ErrRefused, section, err)
	}
	return nil
}
