package inbox

import (
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
)

// FailpointKillAfterCommit names an environment variable for the
// exactly-once tests: with it set to n, the process kills itself
// (SIGKILL) after its n-th work commit, before acknowledging the messages
// that commit decided. Unset, it costs nothing.
const FailpointKillAfterCommit = "WORKER_FAILPOINT_INBOX_KILL_AFTER_COMMIT"

func failpointAfterCommit() func(unacked int) {
	n, err := strconv.Atoi(os.Getenv(FailpointKillAfterCommit))
	if err != nil || n < 1 {
		return nil
	}
	var commits atomic.Int64
	return func(unacked int) {
		if commits.Add(1) == int64(n) {
			// The test counts what the kill left for the source to redeliver.
			fmt.Fprintf(os.Stderr, "failpoint: killed after a commit, %d deliveries unacknowledged\n", unacked)
			if p, err := os.FindProcess(os.Getpid()); err == nil {
				_ = p.Kill()
			}
		}
	}
}

// FailpointKillInWork names an environment variable for the crash tests:
// with it set to n, the process kills itself (SIGKILL) in its n-th work
// transaction, after the handlers ran and before the commit, as a crash
// mid-batch would. Unset, it costs nothing.
const FailpointKillInWork = "WORKER_FAILPOINT_INBOX_KILL_IN_WORK"

func failpointInWork() func(messages int) {
	n, err := strconv.Atoi(os.Getenv(FailpointKillInWork))
	if err != nil || n < 1 {
		return nil
	}
	var works atomic.Int64
	return func(messages int) {
		if works.Add(1) == int64(n) {
			fmt.Fprintf(os.Stderr, "failpoint: killed in a work transaction of %d messages\n", messages)
			if p, err := os.FindProcess(os.Getpid()); err == nil {
				_ = p.Kill()
			}
			select {} // the kill is on its way: nothing may commit before it lands
		}
	}
}
