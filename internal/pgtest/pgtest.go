// Package pgtest gives each test its own PostgreSQL database, cloned from a
// migrated template, so test packages run in parallel without sharing state,
// and keeps the suite within its share of the server's connections
// (slots.go). There is no skip: a test that needs PostgreSQL fails when it
// is missing.
package pgtest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/migrations"
)

// AdminURL is the server the tests use: WORKER_TEST_DATABASE_URL, or the
// local default. Test databases are created and dropped through it.
func AdminURL() string {
	if u := os.Getenv("WORKER_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// DB is one test's private database.
type DB struct {
	Name string
	URL  string // connection URL for child processes or extra pools
	Pool *pgxpool.Pool
}

// New returns a fresh, fully migrated database that is dropped when t ends.
func New(t testing.TB) *DB { return create(t, templateName) }

// NewEmpty returns a fresh database with no migrations applied.
func NewEmpty(t testing.TB) *DB {
	return create(t, func(testing.TB) string { return "template0" })
}

// NewPool opens another pool on db (a second "replica") of maxConns
// connections (PoolConns when 0), closed when t ends. configure, if given,
// adjusts the pool's configuration first (a tracer, an application_name).
func (db *DB) NewPool(t testing.TB, maxConns int32, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	if maxConns <= 0 {
		maxConns = PoolConns
	}
	return db.openPool(t, maxConns, configure...)
}

// ChildURL is db's URL for a child process of t whose pool opens at most
// poolConns connections (pool_max_conns), and which opens listeners more
// of its own. They are counted in t's admission (Reserve) until release is
// called, when the child has exited, or t ends.
func (db *DB) ChildURL(t testing.TB, poolConns, listeners int) (childURL string, release func()) {
	t.Helper()
	u, err := url.Parse(db.URL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	q := u.Query()
	q.Set("pool_max_conns", fmt.Sprint(poolConns))
	u.RawQuery = q.Encode()
	return u.String(), Reserve(t, poolConns+listeners)
}

// Conn opens a connection of its own to db (a producer's session, a
// LISTEN), closed when t ends.
func (db *DB) Conn(t testing.TB, configure ...func(*pgx.ConnConfig)) *pgx.Conn {
	t.Helper()
	return conn(t, db.URL, configure...)
}

// AdminConn opens a connection to the server's admin database, closed when
// t ends: for what a test database cannot see, such as other databases'
// sessions.
func AdminConn(t testing.TB) *pgx.Conn {
	t.Helper()
	return conn(t, AdminURL())
}

func conn(t testing.TB, u string, configure ...func(*pgx.ConnConfig)) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	for _, f := range configure {
		f(cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := connectConfig(t, ctx, cfg)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// openPool opens a pool of maxConns on db, closed when t ends.
func (db *DB) openPool(t testing.TB, maxConns int32, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	for _, f := range configure {
		f(cfg)
	}
	cfg.MaxConns = maxConns
	counted(t, &cfg.ConnConfig.Config)
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}

func create(t testing.TB, template func(testing.TB) string) *DB {
	t.Helper()
	// Admitted for one connection for creating and dropping the database,
	// and the pool's (building the template, which happens before either,
	// takes no more).
	admissionOf(t, 1+PoolConns, 1+PoolConns)
	tmpl := template(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin := connect(t, ctx, AdminURL())
	defer admin.Close(ctx)
	name := "worker_test_" + randHex(6)
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, tmpl)); err != nil {
		t.Fatalf("pgtest: create database: %v", err)
	}
	db := &DB{Name: name, URL: withDatabase(t, AdminURL(), name)}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c := connect(t, ctx, AdminURL())
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", name)); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	db.Pool = db.openPool(t, PoolConns)
	return db
}

// templateName returns the migrated template for the current migrations,
// building it once per machine and day. The name carries a hash of the
// migration files, so a changed migration builds a new template.
func templateName(t testing.TB) string {
	t.Helper()
	h := sha256.New()
	err := fs.WalkDir(migrations.FS, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(migrations.FS, p)
		h.Write([]byte(p))
		h.Write(b)
		return err
	})
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	// And the day: the migrations create the outbox_event partitions of
	// the day they run and the next, and a test database has no worker to
	// add more.
	name := "worker_tmpl_" + hex.EncodeToString(h.Sum(nil))[:16] + "_" + time.Now().UTC().Format("20060102")

	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	admin := connect(t, ctx, AdminURL())
	defer admin.Close(ctx)
	// Test packages run in parallel processes; one builds the template while
	// the others wait. A session lock is fine here: it is test scaffolding on
	// a dedicated connection, closed right after.
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock(7236501)"); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	var exists bool
	if err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	if exists {
		return name
	}
	build := name + "_build"
	if _, err := admin.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", build)); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE template0", build)); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	pcfg, err := pgxpool.ParseConfig(withDatabase(t, AdminURL(), build))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	pcfg.MaxConns = PoolConns - 1 // with the admin session, within New's admission
	counted(t, &pcfg.ConnConfig.Config)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	err = migrate.Up(ctx, pool, slog.New(slog.DiscardHandler))
	pool.Close()
	if err != nil {
		t.Fatalf("pgtest: migrate template: %v", err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s RENAME TO %s", build, name)); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return name
}

// connect opens an admin connection. A server with no free connection
// (other clients hold its max_connections) is waited for until ctx ends,
// and reported as that, not as a server that is not running.
func connect(t testing.TB, ctx context.Context, u string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return connectConfig(t, ctx, cfg)
}

func connectConfig(t testing.TB, ctx context.Context, cfg *pgx.ConnConfig) *pgx.Conn {
	t.Helper()
	counted(t, &cfg.Config)
	for {
		c, err := pgx.ConnectConfig(ctx, cfg)
		switch {
		case err == nil:
			return c
		case !tooManyClients(err) || ctx.Err() != nil:
			t.Fatal(connectFailure(cfg.ConnString(), err))
		}
		if err := pause(ctx); err != nil {
			t.Fatal(connectFailure(cfg.ConnString(), err))
		}
	}
}

// counted makes each connection cfg opens, and every copy of cfg (a
// listener's, River's pool's) take one of t's connection slots while it is
// open, waiting for one if t has none free (slots.go).
func counted(t testing.TB, cfg *pgconn.Config) {
	t.Helper()
	a := admissionOf(t, 1+PoolConns, 1+PoolConns)
	test, dial := t.Name(), cfg.DialFunc
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if err := a.take(ctx, test, &a.dialed, 1, dialWait); err != nil {
			return nil, err
		}
		c, err := dial(ctx, network, addr)
		if err != nil {
			a.give(&a.dialed, 1)
			return nil, err
		}
		return &countedConn{Conn: c, a: a}, nil
	}
}

// countedConn gives its slot back when it closes.
type countedConn struct {
	net.Conn
	a    *admission
	once sync.Once
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.a.give(&c.a.dialed, 1) })
	return err
}

// connectFailure says why the tests could not connect: a server that has
// no free connection is not a server that is missing.
func connectFailure(u string, err error) string {
	if tooManyClients(err) {
		return fmt.Sprintf("pgtest: PostgreSQL at %s has no free connection (too many clients, SQLSTATE 53300): other clients hold its max_connections; "+
			"give the suite a smaller share (WORKER_TEST_MAX_CONNS, go test -p) or raise max_connections: %v", u, err)
	}
	return fmt.Sprintf("pgtest: PostgreSQL is required at %s (set WORKER_TEST_DATABASE_URL): %v", u, err)
}

// tooManyClients is PostgreSQL refusing a connection for want of a free
// one: max_connections reached (SQLSTATE 53300).
func tooManyClients(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "53300"
}

func withDatabase(t testing.TB, dsn, name string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("pgtest: WORKER_TEST_DATABASE_URL must be a URL: %v", err)
	}
	u.Path = "/" + name
	return u.String()
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
