package startup

import (
	"container/list"
	"net"
	"net/http"
	"sync"
)

// connLimiter caps a server's open connections. A connection beyond the
// cap closes one that is not in a request: the oldest idle between
// requests, or else the oldest still sending its first head. Blocking
// Accept at the cap (as netutil.LimitListener does) would leave the
// kubelet's /livez in the kernel's backlog behind thousands of stalled
// heads, and the pod would be restarted; shedding a waiting connection lets
// any request that arrives whole get through. Idle ones go first: a
// keep-alive connection that already had its answer matters less than one
// that has yet to send its request, a probe's included. Connections in a
// request are never shed: the timeouts bound them. The connections not in
// a request have a cap of their own, below the other: each holds a
// goroutine and its buffers, and a flood of stalled heads would otherwise
// fill the whole cap with them.
type connLimiter struct {
	max, maxWaiting int

	mu          sync.Mutex
	open        map[net.Conn]*list.Element // nil while in a request or being shed
	idle, fresh *list.List                 // connections not in a request, oldest first
}

func newConnLimiter(maxConns, maxWaiting int) *connLimiter {
	return &connLimiter{max: maxConns, maxWaiting: maxWaiting, open: make(map[net.Conn]*list.Element), idle: list.New(), fresh: list.New()}
}

// track is the server's ConnState hook.
func (l *connLimiter) track(c net.Conn, state http.ConnState) {
	var shed net.Conn
	l.mu.Lock()
	switch state {
	case http.StateNew:
		l.open[c] = l.fresh.PushBack(c)
		if len(l.open) > l.max || l.idle.Len()+l.fresh.Len() > l.maxWaiting {
			// c itself when every other one is in a request.
			from := l.idle
			if from.Len() == 0 {
				from = l.fresh
			}
			shed = from.Remove(from.Front()).(net.Conn)
			l.open[shed] = nil
		}
	case http.StateActive:
		l.stopWaiting(c)
		l.open[c] = nil
	case http.StateIdle:
		l.stopWaiting(c)
		l.open[c] = l.idle.PushBack(c)
	case http.StateClosed, http.StateHijacked:
		l.stopWaiting(c)
		delete(l.open, c)
	}
	l.mu.Unlock()
	if shed != nil {
		_ = shed.Close() // its serving goroutine reads the error and reports StateClosed
	}
}

// stopWaiting takes c off the list it waits in, if any (Remove ignores an
// element of another list).
func (l *connLimiter) stopWaiting(c net.Conn) {
	if e := l.open[c]; e != nil {
		l.idle.Remove(e)
		l.fresh.Remove(e)
	}
}
