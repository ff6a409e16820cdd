package pglisten

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// freezer is a TCP proxy to the database whose connections can be frozen:
// they stay open but carry nothing more, like a connection to a server that
// vanished without a reset.
type freezer struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	frozen bool
	conns  []net.Conn
}

func newFreezer(t *testing.T, target string) *freezer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &freezer{ln: ln, target: target}
	t.Cleanup(func() {
		ln.Close()
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, c := range f.conns {
			c.Close()
		}
	})
	go f.serve()
	return f
}

func (f *freezer) serve() {
	for {
		client, err := f.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", f.target)
		if err != nil {
			client.Close()
			continue
		}
		f.mu.Lock()
		f.conns = append(f.conns, client, server)
		f.mu.Unlock()
		go f.pipe(client, server)
		go f.pipe(server, client)
	}
}

// pipe copies until frozen; after that it reads and drops.
func (f *freezer) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if err != nil {
			return
		}
		f.mu.Lock()
		frozen := f.frozen
		f.mu.Unlock()
		if !frozen {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
	}
}

func (f *freezer) freeze() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.frozen = true
}

// session runs Session through the proxy and reports its payloads and end.
type session struct {
	connected chan struct{}
	payloads  chan string
	ended     chan error
}

func startSession(t *testing.T, db *pgtest.DB, proxy *freezer, idle time.Duration) *session {
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(proxy.ln.Addr().String())
	p, _ := strconv.Atoi(port)
	cfg.Host, cfg.Port = host, uint16(p)
	ctx, cancel := context.WithCancel(context.Background())
	s := &session{connected: make(chan struct{}), payloads: make(chan string, 10), ended: make(chan error, 1)}
	go func() {
		_, err := Session(ctx, cfg, "pglisten_test", idle, func() { close(s.connected) },
			func(p string) { s.payloads <- p })
		s.ended <- err
	}()
	t.Cleanup(func() {
		cancel()
		<-s.ended
	})
	select {
	case <-s.connected:
	case err := <-s.ended:
		t.Fatalf("session ended before listening: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("session did not start listening")
	}
	return s
}

func notify(t *testing.T, db *pgtest.DB, payload string) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), "SELECT pg_notify('pglisten_test', $1)", payload); err != nil {
		t.Fatal(err)
	}
}

func dbAddr(t *testing.T, db *pgtest.DB) string {
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
}

// Idle periods pass with health checks, and notifications still arrive
// after them: a wait that timed out did not break the connection.
func TestSessionSurvivesIdlePeriods(t *testing.T) {
	db := pgtest.New(t)
	// Each health check may take up to idle: generous for a loaded machine.
	s := startSession(t, db, newFreezer(t, dbAddr(t, db)), 250*time.Millisecond)
	notify(t, db, "first")
	if got := <-s.payloads; got != "first" {
		t.Fatalf("payload %q, want first", got)
	}
	deadline := time.Now().Add(1250 * time.Millisecond) // five idle periods
	for time.Now().Before(deadline) {
		select {
		case err := <-s.ended:
			t.Fatalf("session ended while idle: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	notify(t, db, "after idle")
	select {
	case got := <-s.payloads:
		if got != "after idle" {
			t.Fatalf("payload %q, want %q", got, "after idle")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no notification after the idle periods")
	}
}

// A connection that goes silent (no reset, no data) ends the session within
// about twice idle, so the caller reconnects instead of waiting for TCP
// keepalive.
func TestSessionEndsOnSilentConnection(t *testing.T) {
	db := pgtest.New(t)
	proxy := newFreezer(t, dbAddr(t, db))
	const idle = 200 * time.Millisecond
	s := startSession(t, db, proxy, idle)
	proxy.freeze()
	frozen := time.Now()
	var ended error
	testkit.Eventually(t, 10*time.Second, "the session to notice its silent connection", func() bool {
		select {
		case ended = <-s.ended:
			return true
		default:
			return false
		}
	})
	s.ended <- ended // for the cleanup
	if ended == nil || errors.Is(ended, context.Canceled) || errors.Is(ended, io.EOF) {
		t.Fatalf("session ended with %v, want a failed health check", ended)
	}
	if took := time.Since(frozen); took > 2*idle+2*time.Second {
		t.Errorf("noticed after %s, want within about 2 x idle (%s)", took, idle)
	}
	t.Logf("silent connection noticed after %s: %v", time.Since(frozen).Round(time.Millisecond), ended)
}

// Run logs a lost connection, reconnects, and says so with how long it was
// down; notifications flow again afterwards.
func TestRunLogsReconnectWithDowntime(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "pglisten-run-test"
	var logs testkit.LogBuffer
	ctx, cancel := context.WithCancel(context.Background())
	connects := make(chan struct{}, 10)
	payloads := make(chan string, 10)
	ended := make(chan struct{})
	l := Listener{Name: "test listener", Config: cfg, Channel: "pglisten_test", Log: logs.Logger(), Fallback: "nothing happens"}
	go func() {
		defer close(ended)
		l.Run(ctx, func() { connects <- struct{}{} }, func(p string) { payloads <- p })
	}()
	t.Cleanup(func() { cancel(); <-ended })

	<-connects
	if lines := logs.Lines(t, "test listener reconnected"); len(lines) != 0 {
		t.Fatalf("the first connect is not a reconnect: %v", lines)
	}
	if _, err := db.Pool.Exec(context.Background(),
		`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pglisten-run-test' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	select {
	case <-connects:
	case <-time.After(15 * time.Second):
		t.Fatal("no reconnect after the connection was terminated")
	}
	if n := len(logs.Lines(t, "test listener disconnected; nothing happens until it reconnects")); n != 1 {
		t.Errorf("%d disconnect lines, want 1:\n%s", n, logs.String())
	}
	up := logs.Lines(t, "test listener reconnected")
	if len(up) != 1 {
		t.Fatalf("%d reconnect lines, want 1:\n%s", len(up), logs.String())
	}
	down, err := time.ParseDuration(fmt.Sprint(up[0]["down_for"]))
	if err != nil || down <= 0 || up[0]["channel"] != "pglisten_test" {
		t.Errorf("reconnect line %v: want channel and a positive down_for (%v)", up[0], err)
	}
	notify(t, db, "after reconnect")
	select {
	case got := <-payloads:
		if got != "after reconnect" {
			t.Fatalf("payload %q", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no notification after the reconnect")
	}
}

// Hooks run on the session's connection: Setup once LISTEN succeeded, Tick
// at once and then every Every, and Ended when a session whose Setup
// succeeded ends; an error of Tick ends the session, and Run starts a new
// one, with Setup again.
func TestRunHooks(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu                    sync.Mutex
		setups, ticks, ends   int
		setupPID, tickPIDs    []uint32
		connectedAfterSetup   = true
		payloads              = make(chan string, 10)
		ended                 = make(chan struct{})
		ctx, cancel           = context.WithCancel(context.Background())
		errTickEndsTheSession = errors.New("the third tick fails")
	)
	l := Listener{Name: "hooks listener", Config: cfg, Channel: "pglisten_test", Hooks: Hooks{
		Setup: func(ctx context.Context, conn *pgx.Conn) error {
			mu.Lock()
			defer mu.Unlock()
			setups++
			setupPID = append(setupPID, conn.PgConn().PID())
			return nil
		},
		Tick: func(ctx context.Context, conn *pgx.Conn) error {
			mu.Lock()
			defer mu.Unlock()
			ticks++
			tickPIDs = append(tickPIDs, conn.PgConn().PID())
			if ticks == 3 {
				return errTickEndsTheSession
			}
			return conn.Ping(ctx)
		},
		Every: 20 * time.Millisecond,
		Ended: func() {
			mu.Lock()
			defer mu.Unlock()
			ends++
		},
	}}
	go func() {
		defer close(ended)
		l.Run(ctx, func() {
			mu.Lock()
			defer mu.Unlock()
			connectedAfterSetup = connectedAfterSetup && setups > 0
		}, func(p string) { payloads <- p })
	}()
	t.Cleanup(func() { cancel(); <-ended })
	testkit.Eventually(t, 15*time.Second, "a second session ticking", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return setups == 2 && ticks >= 5
	})
	notify(t, db, "with ticks")
	select {
	case got := <-payloads:
		if got != "with ticks" {
			t.Fatalf("payload %q", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no notification between ticks")
	}
	mu.Lock()
	defer mu.Unlock()
	if ends != 1 || !connectedAfterSetup {
		t.Errorf("Ended ran %d times, want 1; connected after Setup: %v", ends, connectedAfterSetup)
	}
	if tickPIDs[0] != setupPID[0] || tickPIDs[3] != setupPID[1] || setupPID[0] == setupPID[1] {
		t.Errorf("ticks ran on %v, sessions set up on %v: want each tick on its session's connection", tickPIDs, setupPID)
	}
}
