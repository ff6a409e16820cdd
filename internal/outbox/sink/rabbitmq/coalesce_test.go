package rabbitmq

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/testkit"
)

// countingConn counts the writes that reach it, and holds the first one
// until release is closed.
type countingConn struct {
	net.Conn
	release chan struct{}

	mu     sync.Mutex
	writes int
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.writes++
	first := c.writes == 1
	c.mu.Unlock()
	if first {
		<-c.release
	}
	return c.Conn.Write(p)
}

func (c *countingConn) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writes
}

// pipe returns the two ends of a TCP connection on the loopback.
func pipe(t *testing.T) (client, server net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	client, err = net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { _ = client.Close(); _ = server.Close() })
	return client, server
}

// Writes made while a send is under way go out together, whole and in
// order.
func TestCoalescingConnBatchesWrites(t *testing.T) {
	t.Parallel()
	client, server := pipe(t)
	cc := &countingConn{Conn: client, release: make(chan struct{})}
	c := newCoalescingConn(cc)
	defer c.Close()

	var want bytes.Buffer
	for i := range 10 {
		msg := fmt.Appendf(nil, "frame %d;", i)
		want.Write(msg)
		if n, err := c.Write(msg); err != nil || n != len(msg) {
			t.Fatalf("write %d: %d, %v", i, n, err)
		}
		if i == 0 {
			// The first write is being sent (and held): the others queue.
			testkit.Eventually(t, 10*time.Second, "the first send to start", func() bool { return cc.count() == 1 })
		}
	}
	close(cc.release)
	got := make([]byte, want.Len())
	if _, err := io.ReadFull(server, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want.Bytes()) {
		t.Errorf("the peer read %q, want %q", got, want.Bytes())
	}
	if n := cc.count(); n != 2 {
		t.Errorf("%d writes reached the connection for 10 written, want 2: the first, then the nine queued behind it", n)
	}
}

// A failed send closes the connection, so a reader on it fails too, and
// later writes return the error.
func TestCoalescingConnFailedSend(t *testing.T) {
	t.Parallel()
	client, _ := pipe(t)
	c := newCoalescingConn(client)
	defer c.Close()
	_ = client.SetWriteDeadline(time.Now().Add(-time.Second)) // every send fails
	if _, err := c.Write([]byte("lost")); err != nil {
		t.Fatalf("the first write only queues, yet: %v", err)
	}
	testkit.Eventually(t, 10*time.Second, "a later write to return the send's error", func() bool {
		_, err := c.Write([]byte("x"))
		return err != nil
	})
	if _, err := client.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Errorf("reading the connection after a failed send: %v, want it closed", err)
	}
}

// Close sends what is queued first, such as the connection.close-ok the
// client writes right before closing, and gives up on a peer that does not
// read.
func TestCoalescingConnClose(t *testing.T) {
	t.Parallel()
	t.Run("sends what is queued", func(t *testing.T) {
		t.Parallel()
		client, server := pipe(t)
		cc := &countingConn{Conn: client, release: make(chan struct{})}
		c := newCoalescingConn(cc)
		if _, err := c.Write([]byte("first;")); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 10*time.Second, "the first send to start", func() bool { return cc.count() == 1 })
		if _, err := c.Write([]byte("close-ok")); err != nil {
			t.Fatal(err)
		}
		closed := make(chan error, 1)
		go func() { closed <- c.Close() }()
		testkit.Eventually(t, 10*time.Second, "Close to start", func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			return c.closed
		})
		close(cc.release)
		got, err := io.ReadAll(server)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != "first;close-ok" {
			t.Errorf("the peer read %q before the close", got)
		}
		if err := <-closed; err != nil {
			t.Errorf("close: %v", err)
		}
		if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Errorf("write after close: %v", err)
		}
	})
	t.Run("a peer that does not read", func(t *testing.T) {
		t.Parallel()
		client, server := net.Pipe() // unbuffered: the send blocks until the peer reads
		defer server.Close()
		c := newCoalescingConn(client)
		if _, err := c.Write([]byte("never read")); err != nil {
			t.Fatal(err)
		}
		closed := make(chan error, 1)
		go func() { closed <- c.Close() }()
		select {
		case <-closed:
		case <-time.After(30 * time.Second):
			t.Fatal("Close waits for a peer that does not read")
		}
	})
}

// Writers wait while maxQueued bytes are queued, and go on once the peer
// reads.
func TestCoalescingConnBoundsQueued(t *testing.T) {
	t.Parallel()
	client, server := net.Pipe() // unbuffered: the send blocks until the peer reads
	defer server.Close()
	c := newCoalescingConn(client)
	defer c.Close()
	const chunk = 64 << 10
	if _, err := c.Write(make([]byte, chunk)); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the first chunk to be sent", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.sending && len(c.queued) == 0
	})
	// That send blocks: maxQueued bytes queue behind it, and the next
	// write has to wait.
	chunks := maxQueued/chunk + 1
	var written atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range chunks {
			if _, err := c.Write(make([]byte, chunk)); err != nil {
				t.Error(err)
				return
			}
			written.Add(chunk)
		}
	}()
	testkit.Eventually(t, 10*time.Second, "maxQueued bytes to queue", func() bool {
		return written.Load() == maxQueued
	})
	// Only a missing bound could let the last write through meanwhile.
	select {
	case <-done:
		t.Fatal("a write went through with maxQueued bytes queued for a peer that reads nothing")
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := io.CopyN(io.Discard, server, int64(1+chunks)*chunk); err != nil {
		t.Fatal(err)
	}
	<-done
	if written.Load() != int64(chunks)*chunk {
		t.Errorf("wrote %d bytes, want %d", written.Load(), chunks*chunk)
	}
}
