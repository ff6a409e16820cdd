package opsserver

import (
	"container/list"
	"net"
	"net/http"
	"sync"
	"time"
)

// connLimiter caps a server's open connections. At the cap, Accept first
// closes one that is not in a request and whose client is what it waits
// for, so the cap holds the connection it accepts next: the oldest idle
// between requests, or else the oldest still sending its first head once
// that one has had its grace to send it. A connection with bytes the
// server has yet to read is never shed: the server is behind, not its
// client. Until one can be shed, Accept waits, and the kernel's backlog
// holds the rest of a burst.
//
// Waiting for a connection to close (as netutil.LimitListener does) would
// leave the kubelet's /livez in the backlog behind thousands of stalled
// heads, and the pod would be restarted; shedding the oldest at once would
// close a probe whose head a busy server had not read yet when a burst of
// newer connections arrived. Idle ones go first, at any age: a keep-alive
// connection that already had its answer matters less than one that has
// yet to send its request. Connections in a request are never shed: the
// timeouts bound them.
type connLimiter struct {
	max   int
	grace time.Duration

	mu          sync.Mutex
	open        map[net.Conn]*list.Element // nil while in a request
	idle, fresh *list.List                 // of *waiting, oldest first
	changed     chan struct{}              // a connection closed, or may be shed now
}

// waiting is a connection not in a request.
type waiting struct {
	conn   net.Conn
	opened time.Time // fresh ones only
}

func newConnLimiter(maxConns int, grace time.Duration) *connLimiter {
	return &connLimiter{max: maxConns, grace: grace, open: make(map[net.Conn]*list.Element),
		idle: list.New(), fresh: list.New(), changed: make(chan struct{}, 1)}
}

// listener is ln with Accept held while the limiter has no room.
func (l *connLimiter) listener(ln net.Listener) net.Listener {
	return &limitedListener{Listener: ln, limit: l, closed: make(chan struct{})}
}

type limitedListener struct {
	net.Listener
	limit     *connLimiter
	closeOnce sync.Once
	closed    chan struct{}
}

func (ln *limitedListener) Accept() (net.Conn, error) {
	if !ln.limit.makeRoom(ln.closed) {
		return nil, net.ErrClosed
	}
	c, err := ln.Listener.Accept()
	if err != nil {
		return nil, err
	}
	ln.limit.mu.Lock()
	ln.limit.open[c] = ln.limit.fresh.PushBack(&waiting{conn: c, opened: time.Now()})
	ln.limit.mu.Unlock()
	return c, nil
}

func (ln *limitedListener) Close() error {
	ln.closeOnce.Do(func() { close(ln.closed) })
	return ln.Listener.Close()
}

// makeRoom returns when a connection may be accepted, shedding one if the
// cap needs it; false when closed ends the wait.
func (l *connLimiter) makeRoom(closed <-chan struct{}) bool {
	for {
		l.mu.Lock()
		shed, wait := l.room()
		l.mu.Unlock()
		if shed != nil {
			_ = shed.Close() // its serving goroutine reads the error and reports StateClosed
		}
		if wait == 0 {
			return true
		}
		t := time.NewTimer(wait)
		select {
		case <-l.changed:
		case <-t.C:
		case <-closed:
			t.Stop()
			return false
		}
		t.Stop()
	}
}

// room picks the connection to shed, if the cap needs one, or else says how
// long to wait: until the oldest fresh one's grace ends, or until a
// connection changes.
func (l *connLimiter) room() (shed net.Conn, wait time.Duration) {
	if len(l.open) < l.max {
		return nil, 0
	}
	wait = l.grace
	for _, from := range []*list.List{l.idle, l.fresh} {
		for e := from.Front(); e != nil; e = e.Next() {
			w := e.Value.(*waiting)
			if from == l.fresh {
				if age := time.Since(w.opened); age < l.grace {
					wait = min(wait, l.grace-age)
					break // the rest are younger
				}
			}
			if !unread(w.conn) {
				from.Remove(e)
				delete(l.open, w.conn)
				return w.conn, 0
			}
		}
	}
	return nil, wait
}

// track is the server's ConnState hook. A new connection is already
// fresh: the listener opened it.
func (l *connLimiter) track(c net.Conn, state http.ConnState) {
	if state == http.StateNew {
		return
	}
	l.mu.Lock()
	e, tracked := l.open[c]
	if e != nil { // Remove ignores an element of another list
		l.idle.Remove(e)
		l.fresh.Remove(e)
	}
	switch {
	case !tracked: // shed, or opened by another listener
	case state == http.StateActive:
		l.open[c] = nil
	case state == http.StateIdle:
		l.open[c] = l.idle.PushBack(&waiting{conn: c})
	case state == http.StateClosed, state == http.StateHijacked:
		delete(l.open, c)
	}
	l.mu.Unlock()
	select {
	case l.changed <- struct{}{}:
	default:
	}
}
