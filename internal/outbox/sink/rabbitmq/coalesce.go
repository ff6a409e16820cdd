package rabbitmq

import (
	"net"
	"sync"
	"time"
)

// maxQueued bounds the bytes a coalescingConn holds for the broker: past
// it writers wait, as they would on a full socket buffer (a broker that
// stopped reading, for example while it blocks the connection).
const maxQueued = 1 << 20

// closeFlush is how long Close tries to send what is still queued (such as
// the library's connection.close-ok) before it closes anyway.
const closeFlush = 100 * time.Millisecond

// coalescingConn is the broker connection as the AMQP client sees it. The
// client writes each message (its method, header and body frames) with a
// system call of its own, under its connection lock, so concurrent
// publishes queue behind each other's system calls. Here a write only
// queues the bytes, and one goroutine sends, in one system call, whatever
// queued while its previous one was under way: with the relay's publishes
// in flight that is several messages per call, for the client and for the
// broker's reader alike.
//
// A failed send closes the connection, so the client's reader fails too and
// the client shuts the connection down; the publishes waiting for their
// confirms fail as they would on a lost connection, and later writes
// return the error.
type coalescingConn struct {
	net.Conn

	mu      sync.Mutex
	changed sync.Cond // bytes queued, a send ended, or the connection closed
	queued  []byte
	spare   []byte // the buffer of the previous send, reused
	sending bool
	closed  bool
	err     error // the send that failed
	done    chan struct{}
}

func newCoalescingConn(c net.Conn) *coalescingConn {
	cc := &coalescingConn{Conn: c, done: make(chan struct{})}
	cc.changed.L = &cc.mu
	go cc.send()
	return cc
}

// Write queues p and returns at once, unless maxQueued bytes wait already.
func (c *coalescingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.queued) >= maxQueued && c.err == nil && !c.closed {
		c.changed.Wait()
	}
	switch {
	case c.err != nil:
		return 0, c.err
	case c.closed:
		return 0, net.ErrClosed
	}
	c.queued = append(c.queued, p...)
	c.changed.Broadcast()
	return len(p), nil
}

// send writes the queued bytes until the connection fails or is closed
// with nothing left to send.
func (c *coalescingConn) send() {
	defer close(c.done)
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		for len(c.queued) == 0 && !c.closed {
			c.changed.Wait()
		}
		if len(c.queued) == 0 {
			return // closed, everything sent
		}
		out := c.queued
		c.queued, c.sending = c.spare[:0], true
		c.mu.Unlock()
		_, err := c.Conn.Write(out)
		c.mu.Lock()
		c.spare, c.sending = out, false
		if err != nil {
			c.err, c.queued = err, nil
			_ = c.Conn.Close()
			c.changed.Broadcast()
			return
		}
		c.changed.Broadcast()
	}
}

// Close sends what is queued, for at most closeFlush, and closes.
func (c *coalescingConn) Close() error {
	c.mu.Lock()
	c.closed = true
	pending := c.sending || len(c.queued) > 0
	c.changed.Broadcast()
	c.mu.Unlock()
	if pending {
		_ = c.Conn.SetWriteDeadline(time.Now().Add(closeFlush))
	}
	<-c.done
	return c.Conn.Close()
}
