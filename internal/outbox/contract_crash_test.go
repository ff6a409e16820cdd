package outbox_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// contractHelperEnv carries the database URL to the relay child process of
// TestContractCrashMidBatch. Without it TestContractHelperRelayProcess does
// nothing.
const contractHelperEnv = "OUTBOX_CONTRACT_HELPER_DATABASE_URL"

// contractSlowDelay is how long the child's sink takes per event, so the
// test can kill it in the middle of a batch.
const contractSlowDelay = 200 * time.Millisecond

// contractCrashConfig is the configuration of the killed relay and of the
// one that takes over.
func contractCrashConfig() outboxconfig.Config {
	cfg := contractConfig()
	cfg.BatchSize = 10
	cfg.InFlightTimeout = 10 * time.Second
	// Publishes finish inside the batch transaction (none is detached), so
	// the claims of the killed batch are its row locks, which die with the
	// connection.
	cfg.DetachAfter = cfg.InFlightTimeout / 2
	return cfg
}

// contractStdoutSink "publishes" an event by waiting contractSlowDelay and
// then printing its event_id on stdout, which the parent test reads.
type contractStdoutSink struct{ mu sync.Mutex }

func (s *contractStdoutSink) Name() string { return "contract-stdout" }

func (s *contractStdoutSink) Publish(ctx context.Context, e outbox.Event) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(contractSlowDelay):
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	_, err := fmt.Fprintf(os.Stdout, "published %s\n", e.EventID)
	return err
}

// TestContractHelperRelayProcess is the body of the child process that
// TestContractCrashMidBatch kills; on its own it returns at once.
func TestContractHelperRelayProcess(t *testing.T) {
	url := os.Getenv(contractHelperEnv)
	if url == "" {
		return
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	r, err := outbox.NewRelay(pool, &contractStdoutSink{}, contractCrashConfig(), "doomed", log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The parent kills us long before this; the bound only keeps an
	// orphaned child from living on.
	time.Sleep(time.Minute)
	t.Fatal("relay process was not killed")
}

// TestContractCrashMidBatch: a relay process is SIGKILLed in the middle of a
// batch. Nothing is lost: a relay started afterwards publishes every event,
// redelivering (at least once) the events of the killed batch promptly,
// because the dead process's claims die with its connection.
func TestContractCrashMidBatch(t *testing.T) {
	const events = 40
	db := pgtest.New(t)
	ctx := context.Background()
	cfg := contractCrashConfig()
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
SELECT $1, 'agg-' || g % 4, 'order.updated', jsonb_build_object('g', g)
FROM generate_series(1, $2) g ORDER BY g`, contractAggregateType, events); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestContractHelperRelayProcess$", "-test.count=1", "-test.timeout=2m")
	childURL, _ := db.ChildURL(t, 4, 1) // the relay's pool and its listener
	cmd.Env = append(os.Environ(), contractHelperEnv+"="+childURL)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var (
		mu          sync.Mutex
		childOutput []string // event_ids the child's sink accepted, in order
	)
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if id, ok := strings.CutPrefix(sc.Text(), "published "); ok {
				mu.Lock()
				childOutput = append(childOutput, id)
				mu.Unlock()
			}
		}
	}()
	killed := false
	t.Cleanup(func() {
		if !killed {
			_ = cmd.Process.Kill()
			<-readerDone
			_ = cmd.Wait()
		}
		if t.Failed() {
			t.Logf("child stderr:\n%s", stderr.String())
		}
	})
	childCount := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(childOutput)
	}

	// One full batch committed, and a few events into the next one.
	testkit.Eventually(t, 30*time.Second, "the child relay to be a few events into its second batch", func() bool {
		return childCount() >= cfg.BatchSize+3
	})
	if err := cmd.Process.Kill(); err != nil { // SIGKILL
		t.Fatal(err)
	}
	killedAt := time.Now()
	killed = true
	<-readerDone
	_ = cmd.Wait()

	// The killed batch: events the child's sink accepted whose outcome the
	// child never committed.
	var committed, killedBatch []string
	for _, id := range childOutput {
		if contractStatusOf(t, db.Pool, id) == outbox.StatusPublished {
			committed = append(committed, id)
		} else {
			killedBatch = append(killedBatch, id)
		}
	}
	if len(killedBatch) == 0 {
		t.Fatalf("the kill missed the batch: all %d events the child published were committed", len(childOutput))
	}
	t.Logf("child published %d events, %d committed, %d in the killed batch", len(childOutput), len(committed), len(killedBatch))

	rec := newContractRecordingSink(nil)
	contractStartRelay(t, db.Pool, rec, cfg, "survivor", nil, prometheus.NewRegistry())
	testkit.Eventually(t, cfg.InFlightTimeout+30*time.Second, "every event PUBLISHED", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusPublished) == events
	})

	// Redelivery of the killed batch is quick: no visibility timeout to wait
	// out, the claims died with the connection.
	var redelivered time.Duration
	for _, id := range killedBatch {
		at, ok := rec.deliveredAt(id)
		if !ok {
			t.Fatalf("event %s of the killed batch was not redelivered", id)
		}
		redelivered = max(redelivered, at.Sub(killedAt))
	}
	t.Logf("killed batch redelivered %s after SIGKILL", redelivered.Round(time.Millisecond))
	if bound := cfg.InFlightTimeout + 3*time.Second; redelivered > bound {
		t.Errorf("killed batch redelivered after %s, want within %s", redelivered, bound)
	}

	// Nothing lost, committed events not redelivered, order kept.
	for _, id := range committed {
		if n := rec.deliveredCount(id); n != 0 {
			t.Errorf("event %s was committed PUBLISHED by the killed relay but delivered again %d times", id, n)
		}
	}
	for _, r := range contractRows(t, db.Pool) {
		if r.Status != outbox.StatusPublished {
			t.Errorf("event %s: status %s, want PUBLISHED", r.EventID, r.Status)
		}
		if !slices.Contains(committed, r.EventID) && rec.deliveredCount(r.EventID) != 1 {
			t.Errorf("event %s delivered %d times by the survivor, want 1", r.EventID, rec.deliveredCount(r.EventID))
		}
	}
	contractAssertAggregateOrder(t, db.Pool, rec)
}

// contractAssertAggregateOrder checks that, per aggregate, the sink received
// events in id order.
func contractAssertAggregateOrder(t testing.TB, pool *pgxpool.Pool, rec *contractRecordingSink) {
	t.Helper()
	pos := map[string]int64{}
	for _, r := range contractRows(t, pool) {
		pos[r.EventID] = r.ID
	}
	last := map[string]int64{}
	for _, d := range rec.deliveries() {
		id := pos[d.Event.EventID]
		if id <= last[d.Event.AggregateID] {
			t.Errorf("aggregate %s: event id %d arrived after id %d", d.Event.AggregateID, id, last[d.Event.AggregateID])
		}
		last[d.Event.AggregateID] = id
	}
}
