package startup

import (
	"errors"
	"fmt"

	"worker/internal/obs"
)

// Exit codes (sysexits), as documented in the README.
const (
	ExitOK          = 0
	ExitInterrupted = 1  // a second signal during shutdown, or a signal to an operator command
	ExitUnhealthy   = 1  // worker healthcheck: the local worker is not ready
	ExitUsage       = 64 // bad command line or argument
	ExitDataErr     = 65 // the named item's data forbids the operation
	ExitNoInput     = 66 // a named item (event, database) does not exist
	ExitUnavailable = 69 // a dependency unreachable at start
	ExitInternal    = 70 // internal error only; an operator mistake is never 70
	ExitOSError     = 71 // the system refused a resource, such as a port in use
	ExitUnsafe      = 72 // multi-instance without a shared lock provider
	ExitTempFail    = 75 // refused for now (a full task queue); retry later
	ExitNoPerm      = 77 // a dependency refused our credentials
	ExitConfig      = 78 // invalid configuration
)

// ExitCode maps an error from a command to the process exit code.
func ExitCode(err error) int {
	var (
		ce *ConfigError
		se *SafetyError
		ae *AuthError
		ne *NotFoundError
		de *DataError
		oe *OSError
		ue *UnavailableError
		us *usageError
		uh *unhealthyError
	)
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &uh):
		return ExitUnhealthy
	case errors.Is(err, errInterrupted):
		return ExitInterrupted
	case errors.As(err, &ce):
		return ExitConfig
	case errors.As(err, &se):
		return ExitUnsafe
	case errors.As(err, &ae):
		return ExitNoPerm
	case errors.As(err, &ne):
		return ExitNoInput
	case errors.As(err, &de):
		return ExitDataErr
	case errors.As(err, &oe):
		return ExitOSError
	case errors.As(err, &ue):
		return ExitUnavailable
	case errors.As(err, &us):
		return ExitUsage
	case obs.CodeOf(err) == obs.CodeJobExecutorRejected:
		return ExitTempFail
	}
	return ExitInternal
}

// The error types below each pick one exit code. Msg says what is wrong in
// the operator's terms (the key, variable or item); Err keeps the cause for
// errors.Is and errors.As.

// ConfigError is invalid configuration: exit 78.
type ConfigError struct {
	Msg string
	Err error
}

func (e *ConfigError) Error() string { return "invalid configuration: " + e.Msg }
func (e *ConfigError) Unwrap() error { return e.Err }

// configErrorf builds a ConfigError; a %w verb keeps the cause.
func configErrorf(format string, a ...any) error {
	err := fmt.Errorf(format, a...)
	return &ConfigError{Msg: err.Error(), Err: errors.Unwrap(err)}
}

// SafetyError means multi-instance mode lacks a shared lock: exit 72. Every
// replica would otherwise run every job, so the worker refuses to start.
type SafetyError struct {
	Msg string
	Err error
}

func (e *SafetyError) Error() string { return "unsafe multi-instance setup: " + e.Msg }
func (e *SafetyError) Unwrap() error { return e.Err }

// AuthError is a dependency refusing our credentials: exit 77, at once,
// because retrying cannot help.
type AuthError struct {
	Msg string
	Err error
}

func (e *AuthError) Error() string { return e.Msg }
func (e *AuthError) Unwrap() error { return e.Err }

// NotFoundError is a named item that does not exist: exit 66.
type NotFoundError struct {
	Msg string
	Err error
}

func (e *NotFoundError) Error() string { return e.Msg }
func (e *NotFoundError) Unwrap() error { return e.Err }

// DataError is an operation that the named item's own data forbids, such
// as requeuing an event that breaks a producer rule: exit 65.
type DataError struct {
	Msg string
	Err error
}

func (e *DataError) Error() string { return e.Msg }
func (e *DataError) Unwrap() error { return e.Err }

// OSError is a resource the system refused, such as a port already in use:
// exit 71.
type OSError struct {
	Msg string
	Err error
}

func (e *OSError) Error() string { return e.Msg }
func (e *OSError) Unwrap() error { return e.Err }

// UnavailableError is a dependency that stayed unreachable: exit 69.
type UnavailableError struct {
	Msg string
	Err error
}

func (e *UnavailableError) Error() string { return e.Msg }
func (e *UnavailableError) Unwrap() error { return e.Err }

// errInterrupted is an operator command stopped by SIGINT or SIGTERM before
// it finished: exit 1.
var errInterrupted = errors.New("interrupted by a signal before the command finished")

// usageError is a bad command line or argument: exit 64.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }
