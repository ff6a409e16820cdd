package inbox

import (
	"os"
	"strconv"
	"sync/atomic"
)

// FailpointKillAfterCommit names an environment variable for the
// exactly-once tests: with it set to n, the process kills itself
// (SIGKILL) after its n-th work commit, before acknowledging the messages
// that commit decided. Unset, it costs nothing.
const FailpointKillAfterCommit = "WORKER_FAILPOINT_INBOX_KILL_AFTER_COMMIT"

func failpointAfterCommit() func() {
	n, err := strconv.Atoi(os.Getenv(FailpointKillAfterCommit))
	if err != nil || n < 1 {
		return nil
	}
	var commits atomic.Int64
	return func() {
		if commits.Add(1) == int64(n) {
			if p, err := os.FindProcess(os.Getpid()); err == nil {
				_ = p.Kill()
			}
		}
	}
}
