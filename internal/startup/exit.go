package startup

import (
	"errors"

	"worker/internal/obs"
)

// Exit codes (sysexits), as documented in the README.
const (
	ExitOK          = 0
	ExitInterrupted = 1  // a second signal during shutdown
	ExitUsage       = 64 // bad command line
	ExitNoInput     = 66 // a named item does not exist
	ExitUnavailable = 69 // a dependency unreachable at start
	ExitInternal    = 70
	ExitUnsafe      = 72 // multi-instance without a shared lock provider
	ExitTempFail    = 75 // refused for now (a full task queue); retry later
	ExitConfig      = 78 // invalid configuration
)

// ExitCode maps an error from a command to the process exit code.
func ExitCode(err error) int {
	var (
		ue *UnavailableError
		se *SafetyError
		us *usageError
		nf *notFoundError
	)
	switch {
	case err == nil:
		return ExitOK
	case isConfigError(err):
		return ExitConfig
	case errors.As(err, &se):
		return ExitUnsafe
	case errors.As(err, &ue):
		return ExitUnavailable
	case errors.As(err, &us):
		return ExitUsage
	case errors.As(err, &nf):
		return ExitNoInput
	case obs.CodeOf(err) == obs.CodeJobExecutorRejected:
		return ExitTempFail
	}
	return ExitInternal
}

type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

type notFoundError struct{ msg string }

func (e *notFoundError) Error() string { return e.msg }
