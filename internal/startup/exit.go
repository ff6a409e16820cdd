package startup

import "errors"

// Exit codes (sysexits), as documented in the README.
const (
	ExitOK          = 0
	ExitInterrupted = 1  // a second signal during shutdown
	ExitUnhealthy   = 1  // worker healthcheck: the local worker is not ready
	ExitUsage       = 64 // bad command line
	ExitUnavailable = 69 // a dependency unreachable at start
	ExitInternal    = 70
	ExitUnsafe      = 72 // multi-instance without a shared lock provider
	ExitConfig      = 78 // invalid configuration
)

// ExitCode maps an error from a command to the process exit code.
func ExitCode(err error) int {
	var (
		ue *UnavailableError
		se *SafetyError
		us *usageError
		uh *unhealthyError
	)
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &uh):
		return ExitUnhealthy
	case isConfigError(err):
		return ExitConfig
	case errors.As(err, &se):
		return ExitUnsafe
	case errors.As(err, &ue):
		return ExitUnavailable
	case errors.As(err, &us):
		return ExitUsage
	}
	return ExitInternal
}

type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }
