package startup

import (
	"errors"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/obs"
)

// Exit codes (sysexits), as documented in docs/operations.md.
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

// ExitCode maps an error from a command to the process exit code. A
// failed `worker healthcheck` is internal/cli's to map (exit 1).
func ExitCode(err error) int {
	var (
		xe *ExitError
		ce *config.Error
		se *SafetyError
	)
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, errInterrupted):
		return ExitInterrupted
	case errors.As(err, &ce):
		return ExitConfig
	case errors.As(err, &se):
		return ExitUnsafe
	case errors.As(err, &xe):
		return xe.Code
	case obs.CodeOf(err) == obs.CodeJobExecutorRejected:
		return ExitTempFail
	}
	return ExitInternal
}

// The error types below pick the exit code. Msg says what is wrong in the
// operator's terms (the key, variable or item); Err keeps the cause for
// errors.Is and errors.As. config.Error and SafetyError also name the kind
// of mistake in their message; ExitError covers the codes that need no
// more than the message.

// SafetyError means multi-instance mode lacks a shared lock: exit 72. Every
// replica would otherwise run every job, so the worker refuses to start.
type SafetyError struct {
	Msg string
	Err error
}

func (e *SafetyError) Error() string { return "unsafe multi-instance setup: " + e.Msg }
func (e *SafetyError) Unwrap() error { return e.Err }

// errInterrupted is an operator command stopped by SIGINT or SIGTERM before
// it finished: exit 1.
var errInterrupted = errors.New("interrupted by a signal before the command finished")

// ExitError picks the exit code of the sysexits cases that need no more
// than a message: 64, 65, 66, 69, 71 and 77. It is exported for the
// operator commands (internal/cli), whose mistakes use the same codes.
type ExitError struct {
	Code int
	Msg  string
	Err  error
}

func (e *ExitError) Error() string { return e.Msg }
func (e *ExitError) Unwrap() error { return e.Err }
