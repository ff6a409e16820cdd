package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"syscall"
)

// Unreachable reports whether err says a request never reached its peer
// (a broker, a webhook receiver, a task's endpoint), or that its outcome
// is unknown: refused or reset connections, DNS, TLS handshakes,
// timeouts, EOF, an ended context. The outbox's sinks and the http task
// kinds count such a failure against the peer, not the event or task.
func Unreachable(err error) bool {
	var (
		netErr  net.Error
		dnsErr  *net.DNSError
		opErr   *net.OpError
		tlsErr  *tls.RecordHeaderError
		certErr *tls.CertificateVerificationError
	)
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.EPIPE),
		errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH),
		errors.Is(err, net.ErrClosed):
		return true
	case errors.As(err, &dnsErr), errors.As(err, &opErr), errors.As(err, &tlsErr), errors.As(err, &certErr):
		return true
	case errors.As(err, &netErr) && netErr.Timeout():
		return true
	}
	return false
}

// UnavailableStatus reports whether an HTTP answer with this status says
// the receiver, not the request, failed: 408, 429, 502, 503 and 504. A
// 500 is about the request: the receiver answered, and may answer
// other requests.
func UnavailableStatus(code int) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}
