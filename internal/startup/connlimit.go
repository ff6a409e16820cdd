package startup

import (
	"container/list"
	"net"
	"net/http"
	"sync"
)

// connLimiter caps a server's open connections. A connection beyond the
// cap closes the oldest one that is not in a request: one still sending
// its head, or one idle between requests. Blocking Accept at the cap (as
// netutil.LimitListener does) would leave the kubelet's /livez in the
// kernel's backlog behind thousands of stalled heads, and the pod would be
// restarted; shedding the oldest waiting connection lets any request that
// arrives whole get through. Connections in a request are never shed: the
// timeouts bound them.
type connLimiter struct {
	max int

	mu      sync.Mutex
	open    map[net.Conn]*list.Element // nil while in a request or being shed
	waiting *list.List                 // connections not in a request, oldest first
}

func newConnLimiter(maxConns int) *connLimiter {
	return &connLimiter{max: maxConns, open: make(map[net.Conn]*list.Element), waiting: list.New()}
}

// track is the server's ConnState hook.
func (l *connLimiter) track(c net.Conn, state http.ConnState) {
	var shed net.Conn
	l.mu.Lock()
	switch state {
	case http.StateNew:
		l.open[c] = l.waiting.PushBack(c)
		if len(l.open) > l.max {
			// The front is the oldest waiting connection, c itself when
			// every other one is in a request.
			shed = l.waiting.Remove(l.waiting.Front()).(net.Conn)
			l.open[shed] = nil
		}
	case http.StateActive:
		l.stopWaiting(c)
		l.open[c] = nil
	case http.StateIdle:
		l.stopWaiting(c)
		l.open[c] = l.waiting.PushBack(c)
	case http.StateClosed, http.StateHijacked:
		l.stopWaiting(c)
		delete(l.open, c)
	}
	l.mu.Unlock()
	if shed != nil {
		_ = shed.Close() // its serving goroutine reads the error and reports StateClosed
	}
}

func (l *connLimiter) stopWaiting(c net.Conn) {
	if e := l.open[c]; e != nil {
		l.waiting.Remove(e)
	}
}
