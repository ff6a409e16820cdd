package sink

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
)

// TLSConfig builds a client TLS configuration from the files of a sink's
// section: a CA bundle to trust (else the system's) and an optional client
// certificate. prefix is the section's key, for errors.
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
