package testkit

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a throwaway certificate authority. It writes its certificate, and
// each certificate it issues with its key, as PEM files into its directory.
type CA struct {
	File string // the CA certificate
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// Cert is a certificate a CA issued, as files and in memory.
type Cert struct {
	CertFile, KeyFile string
	TLS               tls.Certificate
}

// NewCA creates a CA and writes its certificate and key to dir/name.pem
// and dir/name.key.
func NewCA(t testing.TB, dir, name string) *CA {
	t.Helper()
	ca, err := CreateCA(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// CreateCA is NewCA for setup that outlives the test that runs it, such
// as a broker shared by a package's tests: it returns its error.
func CreateCA(dir, name string) (*CA, error) {
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: name},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	c, err := create(dir, name, tmpl, nil)
	if err != nil {
		return nil, err
	}
	return &CA{File: c.CertFile, dir: dir, cert: c.TLS.Leaf, key: c.TLS.PrivateKey.(*ecdsa.PrivateKey)}, nil
}

// Issue signs a certificate for 127.0.0.1 and localhost with usage
// (server or client authentication) and writes it to name.pem and its key
// to name.key in the CA's directory.
func (ca *CA) Issue(t testing.TB, name string, usage x509.ExtKeyUsage) Cert {
	t.Helper()
	c, err := ca.Create(name, usage)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Create is Issue returning its error, as CreateCA is NewCA.
func (ca *CA) Create(name string, usage x509.ExtKeyUsage) (Cert, error) {
	return create(ca.dir, name, &x509.Certificate{
		Subject:     pkix.Name{CommonName: name},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{usage},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:    []string{"localhost"},
	}, ca)
}

// Pool returns a pool that trusts only ca.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// create makes a key and a certificate from tmpl, signed by ca (self-signed
// when ca is nil), and writes them to dir as name.pem and name.key.
func create(dir, name string, tmpl *x509.Certificate, ca *CA) (Cert, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Cert{}, err
	}
	if tmpl.SerialNumber, err = rand.Int(rand.Reader, big.NewInt(1<<62)); err != nil {
		return Cert{}, err
	}
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
	parent, signer := tmpl, key
	if ca != nil {
		parent, signer = ca.cert, ca.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, signer)
	if err != nil {
		return Cert{}, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return Cert{}, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return Cert{}, err
	}
	c := Cert{
		CertFile: filepath.Join(dir, name+".pem"),
		KeyFile:  filepath.Join(dir, name+".key"),
		TLS:      tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert},
	}
	// Readable by all: a broker that runs as another user reads these
	// throwaway files.
	if err := os.WriteFile(c.CertFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return Cert{}, err
	}
	if err := os.WriteFile(c.KeyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o644); err != nil {
		return Cert{}, err
	}
	return c, nil
}
