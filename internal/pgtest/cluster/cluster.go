// Package cluster runs a private PostgreSQL server for one test or one
// soak: initdb in a directory of its own, a free port, and nothing shared,
// so the caller may restart it, crash it or end its sessions without
// touching the server other tests use. There is no skip: New fails the test
// when the binaries are missing or the server does not start.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Cluster is one private PostgreSQL server, started by pg_ctl.
type Cluster struct {
	Port int
	bin  string // the directory of initdb, pg_ctl and postgres
	dir  string // its data directory
	cred *syscall.Credential
}

// New starts a private server for t, stopped and removed when t ends.
func New(t testing.TB) *Cluster {
	t.Helper()
	c, err := Start()
	if err != nil {
		t.Fatalf("a private PostgreSQL server (scripts/services.sh ensure_postgres installs PostgreSQL): %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// Start starts a private server; Close stops and removes it.
func Start() (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	c := &Cluster{bin: bin}
	// initdb and postgres refuse to run as root: as root, the server runs
	// as the postgres user the package created, as the shared server does.
	if os.Geteuid() == 0 {
		if c.cred, err = postgresUser(); err != nil {
			return nil, err
		}
	}
	// Not under the test's temporary directory: as root, that one is
	// closed to the postgres user.
	if c.dir, err = os.MkdirTemp("", "worker-pg-"); err != nil {
		return nil, err
	}
	if err := c.own(c.dir); err != nil {
		c.remove()
		return nil, err
	}
	if c.Port, err = freePort(); err != nil {
		c.remove()
		return nil, err
	}
	if err := c.init(); err != nil {
		c.remove()
		return nil, err
	}
	if err := c.Start(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// BinDir finds the directory of PostgreSQL's server binaries: the one
// initdb is in on PATH, pg_config's bindir, or the newest of Debian's
// versioned directories, where the package scripts/test installs puts them.
func BinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dir := strings.TrimSpace(string(out))
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { return version(a) - version(b) })
	for _, dir := range slices.Backward(dirs) {
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	return "", errors.New("no initdb on PATH, in pg_config --bindir or in /usr/lib/postgresql/*/bin")
}

func version(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return n
}

func postgresUser() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root, and no postgres user to run the server as: %w", err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func (c *Cluster) own(path string) error {
	if c.cred == nil {
		return nil
	}
	return os.Chown(path, int(c.cred.Uid), int(c.cred.Gid))
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (c *Cluster) data() string { return filepath.Join(c.dir, "data") }

// LogFile is the server's log.
func (c *Cluster) LogFile() string { return filepath.Join(c.dir, "server.log") }

func (c *Cluster) run(name string, args ...string) error {
	cmd := exec.Command(filepath.Join(c.bin, name), args...)
	cmd.Dir = c.dir
	if c.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return nil
}

// init creates the data directory: trust on 127.0.0.1 only, TCP only (no
// socket directory to share), and no fsync, which a crash of the server
// alone (not of the machine) does not need. Commits still wait for their
// WAL write: a crash must not lose a committed transaction.
func (c *Cluster) init() error {
	if err := c.run("initdb", "-D", c.data(), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"); err != nil {
		return err
	}
	conf := fmt.Sprintf(`
port = %d
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 200
shared_buffers = 64MB
fsync = off
full_page_writes = off
log_min_messages = warning
`, c.Port)
	f, err := os.OpenFile(filepath.Join(c.data(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.WriteString(conf)
	return err
}

// URL is the address of database on the server, as the postgres user.
func (c *Cluster) URL(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.Port, database)
}

// Start starts the server and waits until it accepts connections.
func (c *Cluster) Start() error {
	if err := c.run("pg_ctl", "start", "-w", "-t", "60", "-D", c.data(), "-l", c.LogFile()); err != nil {
		return err
	}
	return c.WaitAccepting(60 * time.Second)
}

// Restart is pg_ctl restart -m fast: sessions are ended, the server shuts
// down cleanly and starts again.
func (c *Cluster) Restart() error {
	if err := c.run("pg_ctl", "restart", "-w", "-t", "60", "-m", "fast", "-D", c.data(), "-l", c.LogFile()); err != nil {
		return err
	}
	return c.WaitAccepting(60 * time.Second)
}

// StopImmediate is pg_ctl stop -m immediate: every process ends at once,
// and the next Start is crash recovery.
func (c *Cluster) StopImmediate() error {
	return c.run("pg_ctl", "stop", "-w", "-m", "immediate", "-D", c.data())
}

// WaitAccepting waits until the server accepts a connection and answers a
// query.
func (c *Cluster) WaitAccepting(limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1")
			_ = conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the private server on port %d does not accept connections after %s: %w", c.Port, limit, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Exec runs sql in database as the postgres user.
func (c *Cluster) Exec(ctx context.Context, database, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, c.URL(database))
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

// TerminateBackends ends every client session whose application_name is
// LIKE pattern ("%" for all) but the caller's, and returns how many.
func (c *Cluster) TerminateBackends(ctx context.Context, pattern string) (int, error) {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	err = conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' AND application_name LIKE $1`, pattern).Scan(&n)
	return n, err
}

// Close stops the server at once and removes its directory.
func (c *Cluster) Close() {
	_ = c.StopImmediate()
	c.remove()
}

func (c *Cluster) remove() { _ = os.RemoveAll(c.dir) }
