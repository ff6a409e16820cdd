package jobs

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/worker-dev/worker/internal/lock"
)

// Job is one unit of scheduled work. Run must honour ctx: it is cancelled
// when the run times out, when the run's lease is lost, and at the end of
// the shutdown budget.
type Job interface {
	Name() string
	Run(ctx context.Context) error
}

// Spec is a Job plus its schedule.
type Spec struct {
	Job Job
	// Delay is the rest between the end of one run and the start of the
	// next, cluster-wide, on the database clock. Required.
	Delay time.Duration
	// InitialDelay holds this replica's first attempt back after Start.
	InitialDelay time.Duration
	// Timeout bounds one run; 0 means jobsconfig.DefaultTimeout.
	Timeout time.Duration
	// LeaseTTL is the ttl of lease job:<name>; 0 means Options.LeaseTTL.
	LeaseTTL time.Duration
}

// Func adapts a function to Job, for code jobs that need no state.
func Func(name string, run func(ctx context.Context) error) Job { return funcJob{name, run} }

type funcJob struct {
	name string
	run  func(ctx context.Context) error
}

func (f funcJob) Name() string                  { return f.name }
func (f funcJob) Run(ctx context.Context) error { return f.run(ctx) }

type runKey struct{}

// runInfo is what a run's context carries for the job: its lease (for the
// fencing token and InTx's fence) and id, and whether a fenced transaction
// committed, which decides the outcome if the lease is lost afterwards.
type runInfo struct {
	lease     lock.Lease
	runID     string
	committed atomic.Bool
}

func withRun(ctx context.Context, lease lock.Lease, runID string) (context.Context, *runInfo) {
	ri := &runInfo{lease: lease, runID: runID}
	return context.WithValue(ctx, runKey{}, ri), ri
}

func runOf(ctx context.Context) (*runInfo, bool) {
	ri, ok := ctx.Value(runKey{}).(*runInfo)
	return ri, ok
}

// FencingToken returns the fencing token of the lease the current run
// holds. It is strictly greater than the token of any earlier run of the
// same job on any replica, so a job can guard its writes with it (for
// example `UPDATE ... WHERE last_token < $token`) and a run that lost its
// lease cannot overwrite the work of the run that took over.
func FencingToken(ctx context.Context) (int64, bool) {
	ri, ok := runOf(ctx)
	if !ok {
		return 0, false
	}
	return ri.lease.Token(), true
}

// RunID returns the id (a UUID) of the current run, as logged in run_id.
func RunID(ctx context.Context) (string, bool) {
	ri, ok := runOf(ctx)
	if !ok {
		return "", false
	}
	return ri.runID, true
}
