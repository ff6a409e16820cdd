package broker

import "errors"

// Why a sink or a source could not connect. Startup maps them to exit
// codes: 69, 77, 78.
var (
	// ErrUnreachable: the broker did not answer within its connect_timeout.
	ErrUnreachable = errors.New("broker unreachable")
	// ErrRefused: the broker refused the credentials.
	ErrRefused = errors.New("broker refused the credentials")
	// ErrSetup: the broker answered, but the configuration does not fit it
	// (a missing stream, an exchange of another type). The message names the
	// key to change.
	ErrSetup = errors.New("broker setup does not match the configuration")
)

// Fatal reports whether err is one no retry fixes: ErrRefused or ErrSetup.
// Anything else is the broker's trouble, and worth retrying.
func Fatal(err error) bool { return errors.Is(err, ErrSetup) || errors.Is(err, ErrRefused) }
