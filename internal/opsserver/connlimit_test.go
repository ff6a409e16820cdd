package opsserver

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/testkit"
)

// At the cap, a new connection closes the oldest one that is not in a
// request, once its grace has passed: stalled request heads cannot keep a
// probe out, and the open connections stay at the cap.
func TestConnLimiterShedsTheOldestWaitingConnection(t *testing.T) {
	t.Parallel()
	const maxConns = 3
	testShedsTheOldestWaiting(t, newConnLimiter(maxConns, 10*time.Millisecond), maxConns)
}

// A connection that sends its head within its grace is answered, though
// newer connections beyond the cap arrive meanwhile: shedding at once would
// close it before the server read it.
func TestConnLimiterGivesANewConnectionItsGrace(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	}))
	limitServer(srv, newConnLimiter(2, grace))
	defer srv.Close()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}

	probe := dial() // opens before the others, but sends its head last
	fmt.Fprintf(dial(), "GET / HTTP/1.1\r\nHost: x\r\n")
	for range 3 {
		fmt.Fprintf(dial(), "GET / HTTP/1.1\r\nHost: x\r\n")
	}
	time.Sleep(grace / 4) // the newer connections wait beyond the cap
	start := time.Now()
	fmt.Fprintf(probe, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	_ = probe.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(probe), nil)
	if err != nil {
		t.Fatalf("a head sent within its grace: %v, want an answer", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a head sent within its grace: %d, want 200", resp.StatusCode)
	}
	if d := time.Since(start); d >= grace {
		t.Errorf("answered after %s, want within the grace (%s)", d, grace)
	}
}

func testShedsTheOldestWaiting(t *testing.T, limit *connLimiter, maxConns int) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	}))
	limitServer(srv, limit)
	defer srv.Close()
	addr := srv.Listener.Addr().String()

	var stalled []net.Conn
	stall := func() {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n") // a head that never ends
		stalled = append(stalled, c)
	}
	for range maxConns {
		stall()
	}
	// Each new request gets through, shedding the oldest stalled head; a
	// new stalled head then fills the cap again.
	for i := range maxConns {
		resp, err := (&http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}).Get(srv.URL)
		if err != nil {
			t.Fatalf("request %d at the cap: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d at the cap: %d", i, resp.StatusCode)
		}
		_ = stalled[i].SetReadDeadline(time.Now().Add(10 * time.Second))
		// EOF, or a reset when the head was still unread: closed either way.
		if _, err := io.Copy(io.Discard, stalled[i]); err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("stalled connection %d: %v, want it closed by the server (the oldest waiting)", i, err)
		}
		stall()
	}
}

// limitServer starts srv behind limit.
func limitServer(srv *httptest.Server, limit *connLimiter) {
	srv.Config.ConnState = limit.track
	srv.Listener = limit.listener(srv.Listener)
	srv.Start()
}

// A connection whose bytes the server has yet to read is not shed, though it
// is the oldest and past its grace: the server is behind, not its client.
// A silent one is shed instead.
func TestConnLimiterKeepsAConnectionWithUnreadBytes(t *testing.T) {
	t.Parallel()
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	limit := newConnLimiter(2, 0)
	ln := limit.listener(inner)
	defer ln.Close()
	// No server reads these: Accept alone opens them in the limiter.
	accept := func() (client, server net.Conn) {
		client, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { client.Close() })
		server, err = ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { server.Close() })
		return client, server
	}
	sent, sentServer := accept()
	silent, _ := accept()
	fmt.Fprintf(sent, "GET / HTTP/1.1\r\n")
	testkit.Eventually(t, 10*time.Second, "the head in the server's socket", func() bool { return unread(sentServer) })

	if !limit.makeRoom(nil) {
		t.Fatal("makeRoom ended without room")
	}
	_ = silent.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := silent.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the silent connection: %v, want it shed", err)
	}
	_ = sent.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if _, err := sent.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("the connection with unread bytes: %v, want it open", err)
	}
}
