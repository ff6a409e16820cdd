package startup_test

import (
	"crypto/x509"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// lock.redis over TLS (rediss://), against a redis-server of the test's
// own that requires client certificates: with the CA and a client
// certificate the worker starts; without the CA the server's certificate
// does not verify (exit 78, naming tls_ca_file); without a client
// certificate the server refuses the handshake (exit 77).
func TestRedisOverTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := testkit.NewCA(t, dir, "ca")
	server := ca.Issue(t, "server", x509.ExtKeyUsageServerAuth)
	client := ca.Issue(t, "client", x509.ExtKeyUsageClientAuth)
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	srv := exec.Command("redis-server", "--port", "0", "--bind", "127.0.0.1", "--tls-port", port,
		"--tls-cert-file", server.CertFile, "--tls-key-file", server.KeyFile, "--tls-ca-cert-file", ca.File,
		"--save", "", "--appendonly", "no", "--dir", dir, "--logfile", filepath.Join(dir, "redis.log"))
	if err := srv.Start(); err != nil {
		t.Fatalf("redis-server (scripts/services.sh ensure_redis installs it): %v", err)
	}
	t.Cleanup(func() { _ = srv.Process.Kill(); _ = srv.Wait() })
	testkit.Eventually(t, 10*time.Second, "the TLS redis-server to listen", func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})

	url := "rediss://" + addr + "/0"
	for _, c := range []struct {
		name string
		env  []string
		code int
		says string
	}{
		{"trusted", []string{"APP_LOCK_REDIS_TLS_CA_FILE=" + ca.File,
			"APP_LOCK_REDIS_TLS_CERT_FILE=" + client.CertFile, "APP_LOCK_REDIS_TLS_KEY_FILE=" + client.KeyFile}, 0, "worker ready"},
		{"unknown CA", []string{"APP_LOCK_REDIS_TLS_CERT_FILE=" + client.CertFile, "APP_LOCK_REDIS_TLS_KEY_FILE=" + client.KeyFile}, 78, "lock.redis.tls_ca_file"},
		{"no client certificate", []string{"APP_LOCK_REDIS_TLS_CA_FILE=" + ca.File}, 77, "lock.redis.tls_cert_file"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			p := startWorker(t, append(append([]string{
				"APP_DATABASE_URL=" + db.URL, "APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=redis",
				"APP_LOCK_REDIS_URL=" + url, "APP_DATABASE_CONNECT_TIMEOUT=5s",
			}, replicaOnly...), c.env...))
			if c.code == 0 {
				testkit.Eventually(t, 30*time.Second, "the worker to be ready", func() bool {
					return strings.Contains(p.out.String(), c.says)
				})
				if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
			}
			if code := p.exitCode(t, 30*time.Second); code != c.code {
				t.Fatalf("exit %d, want %d:\n%s", code, c.code, p.out.String())
			}
			if !strings.Contains(p.out.String(), c.says) {
				t.Errorf("output does not say %q:\n%s", c.says, p.out.String())
			}
		})
	}
}
