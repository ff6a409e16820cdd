package obs

import (
	"errors"
	"io"
	"net"
	"strings"
)

// ConnectionLost reports whether err says the database connection failed
// or was ended by the server: refused, reset, cut off, or a server shutting
// down, starting up or ending sessions (SQLSTATE class 08 and 57P). Such a
// failure is the database's outage, which the worker logs once as an
// ERROR (database unreachable); a part that meets it logs a WARN.
func ConnectionLost(err error) bool {
	if err == nil {
		return false
	}
	// pgconn.PgError's method, matched by shape so that logging does not
	// depend on the database driver.
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) {
		code := pgErr.SQLState()
		return strings.HasPrefix(code, "08") || strings.HasPrefix(code, "57P")
	}
	// A socket's error, not any net.Error: context.DeadlineExceeded is one
	// too, and a job's own timeout is not the database's outage.
	var opErr *net.OpError
	if errors.As(err, &opErr) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	return ConnectionLostText(err.Error())
}

// ConnectionLostText is ConnectionLost for an error known only by its text,
// as a library logs it: pgx's words for a failed or ended connection.
func ConnectionLostText(text string) bool {
	for _, s := range []string{"failed to connect to", "(SQLSTATE 08", "(SQLSTATE 57P", "unexpected EOF",
		"connection reset by peer", "connection refused", "broken pipe", "conn closed"} {
		if strings.Contains(text, s) {
			return true
		}
	}
	return false
}
