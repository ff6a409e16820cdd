package startup_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestChaos runs three worker replicas (multi-instance, postgres leases, two
// outbox relays each, webhook sink to a receiver in this test) while a
// producer inserts events over 100 aggregates and a sql job runs, and
// injects faults in rounds until the producer is done: SIGKILL and restart
// of a replica; SIGSTOP of the replica running the job, for longer than
// outbox.in_flight_timeout and the job's lease_ttl, then SIGCONT;
// pg_terminate_backend of every worker session of this test's database;
// the receiver answering 503 to everything for a while.
//
// It asserts that
//   - every event arrives, first deliveries come in per-aggregate order, and
//     duplicates stay within the bound below;
//   - no sql job run commits after a run with a later fencing token started
//     (commit times come from a deferred trigger), and a run is logged as
//     success exactly when it committed;
//   - the malformed rows of issue 9 are refused at INSERT by named
//     constraints, and those already in the table from before the
//     constraints end DEAD, or published in a valid form where the relay can
//     carry them, while every other aggregate keeps flowing.
//
// Duplicate bound. A relay loop has at most one batch whose events may have
// reached the receiver but are not yet marked PUBLISHED (a batch's outcomes
// commit with the next claim). A fault makes those batches go out again:
// relays × batch_size for a SIGKILL or SIGSTOP of one replica, and
// replicas × relays × batch_size for a pg_terminate_backend sweep, which
// hits every replica. The receiver answers in 10ms, far inside the webhook
// timeout, so nothing else repeats an event.
//
// WORKER_CHAOS_DURATION (default 40s) sets how long the producer inserts,
// at 250 events a second and at least 10,000 events in all; fault rounds go
// on until it is done. A soak:
//
//	WORKER_CHAOS_DURATION=10m go test -race -count=1 -timeout 30m -run TestChaos -v ./internal/startup
//
// The figures are printed with t.Log; .ci/run runs this test with -v.
func TestChaos(tt *testing.T) {
	tt.Parallel()
	t := &chaosT{T: tt}
	tt.Cleanup(t.retell) // registered first, so it runs after the workers' logs
	began := time.Now()
	total := max(chaosMinEvents, int(chaosWindow(t).Seconds()*chaosRate))
	// Three replicas and the test's one connection make the suite's whole
	// share of the server (pgtest): the chaos test runs alone.
	pgtest.Need(t, chaosReplicas*chaosReplicaConns+1)
	db := pgtest.New(t)
	db.Pool = db.NewPool(t, 1) // the producer and the checks share it
	createJobTables(t, db)
	preexisting := insertPreexisting(t, db)
	c := &chaosCluster{t: t, db: db, recv: newReceiver(tt), replicas: make([]*proc, chaosReplicas)}
	c.env = []string{
		"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + configFile(tt, chaosJobConfig),
		"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres", "APP_LOG_LEVEL=info",
		// Jobs and the outbox only, on the smallest pool two relay loops
		// allow: chaosReplicaConns each.
		"APP_TASKS_ENABLED=false", "APP_DATABASE_MAX_CONNS=3",
		"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + c.recv.url, "APP_OUTBOX_WEBHOOK_TIMEOUT=2s",
		"APP_OUTBOX_RELAYS=" + strconv.Itoa(chaosRelays), "APP_OUTBOX_BATCH_SIZE=" + strconv.Itoa(chaosBatch),
		"APP_OUTBOX_IN_FLIGHT_TIMEOUT=" + chaosInFlight.String(), "APP_OUTBOX_METRICS_INTERVAL=1s",
		// A producer event must never go DEAD: retry a transient failure (a
		// replica stopped mid-publish) soon, and as often as it takes.
		"APP_OUTBOX_MAX_ATTEMPTS=100", "APP_OUTBOX_BACKOFF_BASE=100ms", "APP_OUTBOX_BACKOFF_MAX=1s",
		"APP_OUTBOX_PROBE_BACKOFF_MAX=200ms",
	}
	if n := workerConns(c.env, nil); n != chaosReplicaConns {
		t.Fatalf("a replica may hold %d connections, want chaosReplicaConns = %d", n, chaosReplicaConns)
	}
	for i := range chaosReplicas {
		c.start(i)
	}
	c.prod = startProducer(tt, db.Pool, total)

	c.eventually(60*time.Second, "producer events to flow beside the malformed rows", func() bool { return c.recv.firstCount() >= 500 })
	refused, year3000 := insertMalformed(t, db)
	dead := c.checkMalformedRows(preexisting, year3000)

	// A paused run commits late only when, after SIGCONT, its COMMIT beats
	// the lease's own expiry check (about one pause in five without fenced
	// commits), so each round pauses the job twice.
	var pauses []pause
	for round := 0; round == 0 || !c.prod.finished(); round++ {
		c.killAndRestart(round % chaosReplicas)
		c.awaitProgress("SIGKILL")
		pauses = append(pauses, c.pauseJobRunner())
		c.awaitProgress("SIGSTOP")
		c.terminateBackends()
		c.awaitProgress("pg_terminate_backend")
		pauses = append(pauses, c.pauseJobRunner())
		c.awaitProgress("SIGSTOP")
		c.sinkOutage()
		c.awaitProgress("sink outage")
	}
	c.eventually(90*time.Second, "every event to reach the receiver", func() bool { return c.recv.firstCount() == total })
	c.eventually(30*time.Second, "every producer event to be marked PUBLISHED", atMostEvery(100*time.Millisecond, func() bool {
		return c.count(`SELECT count(*) FROM outbox_event_state WHERE aggregate_type = 'chaos' AND status <> 'PUBLISHED'`) == 0
	}))
	c.checkHealthy()
	opened := 0
	for _, p := range c.replicas {
		opened += strings.Count(p.out.String(), `"msg":"outbox sink unavailable;`)
	}
	if opened == 0 {
		t.Error("no replica logged its sink unavailable during the receiver's outages")
	}

	d := c.checkDeliveries(total)
	j := c.checkJobRuns()
	c.checkOperatorCommands()

	t.Logf("chaos figures, %s in all:", time.Since(began).Round(time.Second))
	t.Logf("  events: %d over %d aggregates, %d arrived, %d aggregates with first deliveries out of order",
		total, chaosAggregates, d.arrived, d.outOfOrder)
	t.Logf("  duplicates: %d, bound %d = %d relays x batch %d x (%d kills + %d pauses + %d sweeps x %d replicas)",
		d.dups, c.dupBound(), chaosRelays, chaosBatch, c.faults.kills, c.faults.pauses, c.faults.sweeps, chaosReplicas)
	t.Logf("  longest time without a first delivery: %s; longest from producer commit to first delivery: %s",
		d.maxGap.Round(time.Millisecond), d.maxLatency.Round(time.Millisecond))
	t.Logf("  faults: %d SIGKILL+restart, %d SIGSTOP past in_flight_timeout %s and lease_ttl %s, %d pg_terminate_backend sweeps (%d sessions), %d sink outages of %s",
		c.faults.kills, c.faults.pauses, chaosInFlight, chaosLeaseTTL, c.faults.sweeps, c.faults.terminated, c.faults.outages, chaosOutage)
	t.Logf("  sql job: %d committed runs, %d commits after a later token's start, %d outcomes that contradict the commit",
		len(j.committed), j.late, j.contradicted)
	var (
		pausedCommitted, claims int
		longest                 time.Duration
		outcomes                = map[string]int{}
	)
	for _, p := range pauses {
		if _, ok := j.committed[p.token]; ok {
			pausedCommitted++
		}
		claims += p.claims
		longest = max(longest, p.stopped)
		outcomes[p.outcome]++
	}
	t.Logf("  paused runs: %d (stopped up to %s, the replica holding %d relay batches in all), %d committed, logged %v",
		len(pauses), longest.Round(100*time.Millisecond), claims, pausedCommitted, outcomes)
	t.Logf("  malformed rows refused at INSERT: %s", strings.Join(refused, "; "))
	t.Logf("  malformed rows already in the table: %d dead-lettered, %d published", dead, len(preexisting)-dead)
}

const (
	chaosReplicas = 3
	// chaosReplicaConns is what one replica may hold (Config.MaxDBConns):
	// its pool of 3, the readiness probe's, the outbox listener, and the
	// lease pool of 2 with its listener.
	chaosReplicaConns = 8
	chaosRelays       = 2
	chaosBatch        = 25
	chaosAggregates   = 100
	chaosMinEvents    = 10_000
	chaosRate         = 250             // events the producer inserts per second
	chaosInFlight     = 5 * time.Second // outbox.in_flight_timeout
	chaosLeaseTTL     = 2 * time.Second // the job's lease_ttl
	chaosOutage       = 2 * time.Second // how long the receiver is down in a round
	chaosJob          = "chaos-fenced"
	progressStep      = chaosRate // new first deliveries that show the outbox flows after a fault
)

// The job records its start and end with its fencing token; the deferred
// trigger of createJobTables records its commit.
var chaosJobConfig = fmt.Sprintf(`
jobs:
  - name: %s
    kind: sql
    delay: 1s
    lease_ttl: %s
    timeout: 10s
    sql: |
      INSERT INTO chaos_job_mark (token, phase) VALUES (current_setting('worker.fencing_token')::bigint, 'start');
      SELECT pg_sleep(0.6);
      INSERT INTO chaos_job_mark (token, phase) VALUES (current_setting('worker.fencing_token')::bigint, 'end');
`, chaosJob, chaosLeaseTTL)

// chaosWindow is how long the producer runs: WORKER_CHAOS_DURATION or 40s.
func chaosWindow(t testing.TB) time.Duration {
	v := os.Getenv("WORKER_CHAOS_DURATION")
	if v == "" {
		return 40 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("WORKER_CHAOS_DURATION=%q: want a positive duration such as 10m", v)
	}
	return d
}

// chaosCluster is the replicas and what the test did to them.
type chaosCluster struct {
	t        *chaosT
	db       *pgtest.DB
	env      []string
	recv     *receiver
	prod     *producer
	replicas []*proc // the running process of replica-i
	every    []*proc // every replica process started, for the log checks
	faults   struct{ kills, pauses, sweeps, terminated, outages int }
	deadIDs  []string // the malformed rows that went DEAD
}

// chaosT is TestChaos's T. It keeps the test's failures to tell them
// again at the very end: a failed run prints every worker's log after
// them, and a log cut to its tail would not show what failed.
type chaosT struct {
	*testing.T
	mu       sync.Mutex
	failures []string
}

func (t *chaosT) Error(args ...any) { t.Helper(); t.keep(fmt.Sprint(args...)); t.T.Error(args...) }
func (t *chaosT) Fatal(args ...any) { t.Helper(); t.keep(fmt.Sprint(args...)); t.T.Fatal(args...) }

func (t *chaosT) Errorf(format string, args ...any) {
	t.Helper()
	t.keep(fmt.Sprintf(format, args...))
	t.T.Errorf(format, args...)
}

func (t *chaosT) Fatalf(format string, args ...any) {
	t.Helper()
	t.keep(fmt.Sprintf(format, args...))
	t.T.Fatalf(format, args...)
}

// keep keeps a failure's first line: some carry a worker's whole log.
func (t *chaosT) keep(msg string) {
	msg, _, _ = strings.Cut(msg, "\n")
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failures = append(t.failures, msg)
}

func (t *chaosT) retell() {
	if !t.Failed() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.failures) == 0 {
		t.Log("TestChaos failed in a cleanup (a worker's data race, or the database's drop): see above")
		return
	}
	t.Logf("TestChaos failed, as told above the workers' logs:\n\t%s", strings.Join(t.failures, "\n\t"))
}

func replicaID(i int) string { return fmt.Sprintf("replica-%d", i) }

// start starts replica i and waits until it is ready.
func (c *chaosCluster) start(i int) {
	c.t.Helper()
	for attempt := 1; ; attempt++ {
		p := startWorker(c.t.T, append(slices.Clone(c.env), "APP_INSTANCE_ID="+replicaID(i)))
		_, err := p.ready(60 * time.Second)
		if err == nil {
			c.replicas[i] = p
			c.every = append(c.every, p)
			return
		}
		// The worker cannot report a port it chose, so startWorker picks
		// the ops port, and another process may take it first.
		if attempt < 5 && strings.Contains(p.out.String(), "address already in use") {
			continue
		}
		c.t.Fatalf("%s did not start: %v\n%s", replicaID(i), err, p.out.String())
	}
}

// eventually is testkit.Eventually that fails at once when a replica died
// or the producer failed.
func (c *chaosCluster) eventually(within time.Duration, what string, cond func() bool) {
	c.t.Helper()
	testkit.Eventually(c.t, within, what, func() bool {
		c.checkHealthy()
		return cond()
	})
}

func (c *chaosCluster) checkHealthy() {
	c.t.Helper()
	for i, p := range c.replicas {
		select {
		case <-p.done:
			c.t.Fatalf("%s exited by itself, code %d:\n%s", replicaID(i), p.cmd.ProcessState.ExitCode(), p.out.String())
		default:
		}
	}
	select {
	case <-c.prod.done:
		if c.prod.err != nil {
			c.t.Fatal(c.prod.err)
		}
	default:
	}
}

// awaitProgress waits until the receiver has seen progressStep more events
// (or all there will be) for the first time since the fault.
func (c *chaosCluster) awaitProgress(fault string) {
	c.t.Helper()
	want := min(c.recv.firstCount()+progressStep, c.prod.total)
	c.eventually(60*time.Second, "events to flow again after "+fault, func() bool { return c.recv.firstCount() >= want })
}

func (c *chaosCluster) killAndRestart(i int) {
	c.t.Helper()
	p := c.replicas[i]
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		c.t.Fatal(err)
	}
	p.exitCode(c.t, 10*time.Second)
	c.faults.kills++
	c.start(i)
}

// pause is one SIGSTOP of the replica running the sql job.
type pause struct {
	replica string
	token   int64 // of the run in progress when it stopped
	claims  int   // relay batches it held claimed when it stopped
	stopped time.Duration
	outcome string // as the paused replica logged the run
}

// pauseJobRunner stops the replica whose job run is in pg_sleep, found from
// job_state and the session's application_name. It stays stopped past
// in_flight_timeout (the server ends its relays' claim transactions) and
// until another replica, the lease having expired, has committed a later
// run: only then may the paused run try to commit.
func (c *chaosCluster) pauseJobRunner() pause {
	c.t.Helper()
	var pa pause
	c.eventually(60*time.Second, "a run of the sql job in pg_sleep", atMostEvery(20*time.Millisecond, func() bool {
		return c.db.Pool.QueryRow(context.Background(), `SELECT s.last_instance, s.last_token FROM job_state s
			WHERE s.name = $1 AND s.last_outcome = 'running' AND EXISTS (
				SELECT 1 FROM pg_stat_activity a WHERE a.datname = current_database() AND a.state = 'active'
				AND a.application_name = 'worker ' || s.last_instance AND a.query LIKE '%pg_sleep(0.6)%')`,
			chaosJob).Scan(&pa.replica, &pa.token) == nil
	}))
	i := slices.IndexFunc(c.replicas, func(p *proc) bool { return slices.Contains(p.cmd.Env, "APP_INSTANCE_ID="+pa.replica) })
	if i < 0 {
		c.t.Fatalf("job_state names instance %q, not a replica", pa.replica)
	}
	p := c.replicas[i]
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		c.t.Fatal(err)
	}
	stoppedAt := time.Now()
	// Sessions with a transaction id, other than the job's: relay batches
	// holding claims that the server must end after in_flight_timeout.
	pa.claims = c.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND application_name = 'worker ' || $1 AND backend_xid IS NOT NULL AND query NOT LIKE '%pg_sleep(0.6)%'`, pa.replica)
	c.eventually(60*time.Second, "another replica to commit a run while "+pa.replica+" is stopped",
		atMostEvery(50*time.Millisecond, func() bool {
			return time.Since(stoppedAt) > chaosInFlight+time.Second &&
				c.count(`SELECT count(*) FROM chaos_job_commit WHERE token > $1`, pa.token) > 0
		}))
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		c.t.Fatal(err)
	}
	pa.stopped = time.Since(stoppedAt)
	c.faults.pauses++
	c.eventually(30*time.Second, "the paused run's end in "+pa.replica+"'s log", atMostEvery(100*time.Millisecond, func() bool {
		pa.outcome = jobOutcomes(c.t, p)[pa.token]
		return pa.outcome != ""
	}))
	return pa
}

// terminateBackends ends every worker session of this test's database,
// and no other: other tests share the server.
func (c *chaosCluster) terminateBackends() {
	c.t.Helper()
	n := c.count(`SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND (application_name LIKE 'worker %' OR application_name = 'outbox-listener')`)
	if n == 0 {
		c.t.Fatal("pg_terminate_backend found no worker session to end")
	}
	c.faults.sweeps++
	c.faults.terminated += n
}

// sinkOutage has the receiver answer 503 to everything for longer than
// max_attempts quick retries would take, while the producer goes on: the
// replicas must hold the events, not spend their attempts.
func (c *chaosCluster) sinkOutage() {
	c.recv.down.Store(true)
	defer c.recv.down.Store(false)
	t := time.NewTimer(chaosOutage)
	defer t.Stop()
	<-t.C
	c.faults.outages++
}

// dupBound is the most duplicate deliveries the faults injected may cause
// (see TestChaos).
func (c *chaosCluster) dupBound() int {
	return chaosRelays * chaosBatch * (c.faults.kills + c.faults.pauses + c.faults.sweeps*chaosReplicas)
}

func (c *chaosCluster) count(sql string, args ...any) int {
	c.t.Helper()
	var n int
	if err := c.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		c.t.Fatal(err)
	}
	return n
}

// atMostEvery lets a condition that queries the database run at most every
// d, however often Eventually polls.
func atMostEvery(d time.Duration, cond func() bool) func() bool {
	var last time.Time
	return func() bool {
		if time.Since(last) < d {
			return false
		}
		last = time.Now()
		return cond()
	}
}
