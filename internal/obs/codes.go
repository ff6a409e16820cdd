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
	// The OpenTelemetry collector refused spans or could not be reached:
	// they are dropped, and the work goes on. Logged once an outage.
	CodeTraceExportFailed = "TRACE_EXPORT_FAILED"
)

// Codes of a replica that cannot work as it is; each also turns /readyz
// to 503 until the cause is gone.
const (
	// The database's schema version is not the binary's: a replica of
	// another release. Not ready until the versions match.
	CodeSchemaVersionMismatch = "SCHEMA_VERSION_MISMATCH"
	// The lock provider (Redis, or PostgreSQL's lease store) does not
	// answer: no job takes its lease. Logged once when the outage has
	// lasted a lease ttl; retried by itself until it ends.
	CodeLockProviderUnavailable = "LOCK_PROVIDER_UNAVAILABLE"
	// PostgreSQL does not answer a new connection: nothing works until it
	// does. Logged once an outage; every part resumes by itself.
	CodeDatabaseUnavailable = "DATABASE_UNAVAILABLE"
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

// ErrorAttrs are the log attributes of err: "error", and "error.code" when
// err carries a code. A line never gets an empty error.code.
func ErrorAttrs(err error) []any {
	if code := CodeOf(err); code != "" {
		return []any{"error", err, "error.code", code}
	}
	return []any{"error", err}
}
