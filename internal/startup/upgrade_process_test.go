package startup_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// lastV1Commit is the last commit whose worker stores the outbox in V1 (one
// wide outbox_event table): the version operators upgrade from.
const lastV1Commit = "de11fa2576892132a08bf75f8173d92e8520b0f3"

// buildV1Worker builds the worker of lastV1Commit from this repository's
// history. A clone without that commit cannot run the upgrade test, which
// then fails rather than pass untested.
func buildV1Worker(t *testing.T) string {
	t.Helper()
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Fatalf("the upgrade test needs the repository's git history: %v", err)
	}
	src := t.TempDir()
	archive := exec.Command("sh", "-c", `git -C "$1" archive "$2" | tar -x -C "$3"`, "sh", strings.TrimSpace(string(top)), lastV1Commit, src)
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("the upgrade test needs commit %s in the history (a full clone): %v\n%s", lastV1Commit, err, out)
	}
	bin := filepath.Join(t.TempDir(), "worker-v1")
	build := exec.Command("go", "build", "-o", bin, "./cmd/worker")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the V1 worker: %v\n%s", err, out)
	}
	return bin
}

// TestUpgradeToStorageV2Online upgrades a running V1 deployment: two V1
// replicas relay to a webhook while producers commit 200 events/s, with a
// V1 backlog of DEAD events behind them. A first `worker migrate` of the
// new version is killed in the middle of its cutover; V1 carries on as if
// nothing happened. A second one cuts over, a third finds nothing to do.
// Then a rolling restart replaces the replicas one by one. Every event
// committed reaches the receiver, in its aggregate's order; no producer
// sees an error; the DEAD events are carried over as DEAD; and a writer
// still aiming at the V1 table fails loudly.
func TestUpgradeToStorageV2Online(t *testing.T) {
	t.Parallel()
	v1 := buildV1Worker(t)
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	if code := startBinary(t, v1, []string{"APP_DATABASE_URL=" + db.URL}, "migrate").exitCode(t, 60*time.Second); code != 0 {
		t.Fatalf("V1 migrate: exit %d", code)
	}
	// A DEAD backlog, loaded in bulk as the V1 relay would have left it.
	const deadBacklog = 20_000
	for _, q := range []string{
		"ALTER TABLE outbox_event DISABLE TRIGGER USER",
		fmt.Sprintf(`INSERT INTO outbox_event (id, aggregate_type, aggregate_id, event_type, payload, status, attempts, next_attempt_at, last_error)
		 SELECT nextval('outbox_event_id_seq'), 'order', 'dead-' || g %% 100, 'order.changed', '{"a": "dead"}', 'DEAD', 3, now(), 'sink said no'
		 FROM generate_series(1, %d) g`, deadBacklog),
		"ALTER TABLE outbox_event ENABLE TRIGGER USER",
		"VACUUM ANALYZE outbox_event",
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}

	recv := newOutageReceiver(t)
	env := []string{
		"APP_DATABASE_URL=" + db.URL,
		"APP_TASKS_ENABLED=false",
		"APP_OUTBOX_SINK=webhook",
		"APP_OUTBOX_WEBHOOK_URL=http://" + recv.addr + "/events",
		"APP_OUTBOX_WEBHOOK_TIMEOUT=2s",
		"APP_OUTBOX_IN_FLIGHT_TIMEOUT=5s",
		"APP_LOG_LEVEL=info",
	}
	replicas := []*proc{startBinary(t, v1, env), startBinary(t, v1, env)}
	for _, r := range replicas {
		r.waitReady(t, 30*time.Second)
	}

	// Producers: 200 events/s over 10 aggregates, each its own transaction,
	// numbered per aggregate.
	prodCtx, stopProducing := context.WithCancel(ctx)
	defer stopProducing()
	var mu sync.Mutex
	committed := map[string]int{} // aggregate -> events committed
	var produceErrs []error
	var slowest time.Duration // the longest insert: producers wait out the cutover's lock
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-prodCtx.Done():
				return
			case <-tick.C:
			}
			agg := fmt.Sprintf("u-%d", i%10)
			mu.Lock()
			n := committed[agg]
			mu.Unlock()
			start := time.Now()
			_, err := db.Pool.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
				VALUES ('order', $1, 'order.changed', jsonb_build_object('a', $1::text, 'n', $2::int))`, agg, n)
			mu.Lock()
			slowest = max(slowest, time.Since(start))
			if err != nil {
				produceErrs = append(produceErrs, err)
			} else {
				committed[agg] = n + 1
			}
			mu.Unlock()
		}
	})
	testkit.Eventually(t, 20*time.Second, "V1 replicas delivering", func() bool { return recv.distinct() >= 200 })

	// The first cutover is killed halfway: after its rename, before its
	// commit. To hold it there, a transaction of the test rewrites (to the
	// same text) the V1 insert function the cutover replaces right after
	// the rename, so the cutover waits for that row of the catalog.
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	var def string
	if err := holder.QueryRow(ctx, `SELECT pg_get_functiondef('outbox_event_before_insert'::regproc)`).Scan(&def); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, def); err != nil {
		t.Fatal(err)
	}
	first := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL}, "migrate")
	testkit.Eventually(t, 60*time.Second, "the cutover halfway, waiting", func() bool {
		var waiting bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'
			  AND query LIKE '%CREATE OR REPLACE FUNCTION outbox_event_before_insert()%')`).Scan(&waiting)
		return err == nil && waiting
	})
	if err := first.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	first.exitCode(t, 10*time.Second)
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the killed cutover's transaction to end", func() bool {
		var v1Columns bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM information_schema.columns
			WHERE table_name = 'outbox_event' AND column_name = 'status')`).Scan(&v1Columns)
		return err == nil && v1Columns
	})
	delivered := recv.distinct()
	testkit.Eventually(t, 10*time.Second, "V1 still delivering after the killed cutover", func() bool { return recv.distinct() >= delivered+100 })

	for i, want := range []string{"cutover", "nothing to do"} {
		if code := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL}, "migrate").exitCode(t, 120*time.Second); code != 0 {
			t.Fatalf("migrate %d (%s): exit %d", i+2, want, code)
		}
	}
	var storage string
	if err := db.Pool.QueryRow(ctx, `SELECT storage FROM outbox_publication`).Scan(&storage); err != nil || storage != "v2" {
		t.Fatalf("after the cutover: storage %q (%v)", storage, err)
	}

	// Rolling restart onto the new version, one replica at a time.
	for i, old := range replicas {
		if err := old.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if code := old.exitCode(t, 30*time.Second); code != 0 {
			t.Errorf("V1 replica %d stopped with exit %d", i, code)
		}
		replicas[i] = startWorker(t, env)
		replicas[i].waitReady(t, 30*time.Second)
	}
	delivered = recv.distinct()
	testkit.Eventually(t, 20*time.Second, "the new replicas delivering", func() bool { return recv.distinct() >= delivered+200 })
	stopProducing()
	wg.Wait()

	mu.Lock()
	total := 0
	for _, n := range committed {
		total += n
	}
	errs := produceErrs
	mu.Unlock()
	if len(errs) > 0 {
		t.Errorf("%d producer errors, first: %v", len(errs), errs[0])
	}
	testkit.Eventually(t, 60*time.Second, "every committed event delivered", func() bool { return recv.distinct() >= total })
	recv.mu.Lock()
	var lost, reordered int
	for agg, n := range committed {
		got := recv.first[agg]
		seen := map[int]bool{}
		for i, x := range got {
			seen[x] = true
			if i > 0 && x < got[i-1] {
				reordered++
			}
		}
		for x := range n {
			if !seen[x] {
				lost++
			}
		}
	}
	copies := recv.copies
	recv.mu.Unlock()
	t.Logf("%d events committed during the upgrade; %d lost, %d out of order, %d delivered twice (their outcome was unknown when a V1 replica stopped); longest insert %s (the cutover carried %d DEAD events)",
		total, lost, reordered, copies, slowest.Round(time.Millisecond), deadBacklog)
	if lost != 0 || reordered != 0 {
		t.Fatalf("%d lost, %d out of order", lost, reordered)
	}

	var dead int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_delivery WHERE status = 'DEAD' AND attempts = 3 AND last_error = 'sink said no'`).Scan(&dead); err != nil || dead != deadBacklog {
		t.Errorf("DEAD events carried over: %d (%v), want %d", dead, err, deadBacklog)
	}
	_, err = db.Pool.Exec(ctx, `INSERT INTO outbox_event_v1 (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'late', 'x', '{}')`)
	if err == nil || !strings.Contains(err.Error(), "takes no writes") {
		t.Errorf("a write to the V1 table: %v, want a loud refusal", err)
	}
}
