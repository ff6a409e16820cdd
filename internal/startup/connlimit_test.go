package startup

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
	"testing"
	"time"
)

// At the cap, a new connection closes the oldest one that is not in a
// request: stalled request heads cannot keep a probe out, and the open
// connections stay at the cap.
func TestConnLimiterShedsTheOldestWaitingConnection(t *testing.T) {
	t.Parallel()
	const maxConns = 3
	testShedsTheOldestWaiting(t, newConnLimiter(maxConns, maxConns), maxConns)
}

// Below the cap on all connections, the cap on those not in a request sheds
// the same way.
func TestConnLimiterCapsWaitingConnections(t *testing.T) {
	t.Parallel()
	const maxWaiting = 3
	testShedsTheOldestWaiting(t, newConnLimiter(100, maxWaiting), maxWaiting)
}

func testShedsTheOldestWaiting(t *testing.T, limit *connLimiter, maxConns int) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	}))
	srv.Config.ConnState = limit.track
	srv.Start()
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
