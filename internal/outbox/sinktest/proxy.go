package sinktest

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy forwards TCP connections to a broker, so a test can take the
// broker away from one sink without stopping it for everyone: Cut closes
// every connection and refuses new ones, Freeze keeps the connections open
// but forwards nothing more, as a hung broker would, and Restore brings the
// broker back on the same address.
type Proxy struct {
	addr   string
	target string

	mu     sync.Mutex
	ln     net.Listener
	conns  []net.Conn
	frozen bool
}

// NewProxy listens on a free local port and forwards to target; it is cut
// when the test ends.
func NewProxy(t testing.TB, target string) *Proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln, addr: ln.Addr().String(), target: target}
	go p.accept(ln)
	t.Cleanup(p.Cut)
	return p
}

// Addr is host:port to give the sink instead of the broker's.
func (p *Proxy) Addr() string { return p.addr }

func (p *Proxy) accept(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		b, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, b)
		p.mu.Unlock()
		go p.pipe(c, b)
		go p.pipe(b, c)
	}
}

func (p *Proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		frozen := p.frozen
		p.mu.Unlock()
		if n > 0 && !frozen {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				dst.Close()
			}
			return
		}
	}
}

// Freeze stops forwarding: bytes sent either way are dropped.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen = true
}

// Cut closes the listener and every connection.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ln.Close()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// Restore listens again on the same address and forwards what comes, after
// a Cut or a Freeze.
func (p *Proxy) Restore(t testing.TB) {
	t.Helper()
	p.Cut()
	// The port was ours a moment ago; listening again can race the
	// teardown of its last connections.
	var ln net.Listener
	var err error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if ln, err = net.Listen("tcp", p.addr); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("proxy: listening again on %s: %v", p.addr, err)
		}
	}
	p.mu.Lock()
	p.ln, p.frozen = ln, false
	p.mu.Unlock()
	go p.accept(ln)
}
