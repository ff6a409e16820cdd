// Package obs holds what every other package needs to be observable: error
// codes, the JSON logger with secret masking, and the metrics registry.
package obs

import "errors"

// Error codes logged as error.code. Each has a runbook in docs/runbooks/.
const (
	CodeLockAcquisitionTimeout = "LOCK_ACQUISITION_TIMEOUT" // conflict, retryable
	CodeJobExecutorRejected    = "JOB_EXECUTOR_REJECTED"    // transient, retryable
	CodeJobTimeout             = "JOB_TIMEOUT"              // transient, retryable
	CodeJobDeadLetter          = "JOB_DEAD_LETTER"          // internal, not retryable
	CodeInboxWebhookRefused    = "INBOX_WEBHOOK_REFUSED"    // a webhook request refused: the sender's to fix, or retry
)

// Coded is implemented by errors that carry one of the codes above.
type Coded interface {
	error
	Code() string
}

// CodeOf returns the code of the first Coded error in err's chain, or "".
func CodeOf(err error) string {
	var c Coded
	if errors.As(err, &c) {
		return c.Code()
	}
	return ""
}
