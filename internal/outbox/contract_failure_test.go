package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Event types the failing sink reacts to.
const (
	contractFlaky  = "test.flaky"  // fails twice, then succeeds
	contractPoison = "test.poison" // always fails (transient)
	contractPerm   = "test.perm"   // fails permanently
)

// contractFailingBehaviour fails events by event type, as above.
func contractFailingBehaviour(_ context.Context, e outbox.Event, call int) error {
	switch e.EventType {
	case contractFlaky:
		if call <= 2 {
			return fmt.Errorf("flaky sink: call %d", call)
		}
	case contractPoison:
		return errors.New("sink unavailable")
	case contractPerm:
		return outbox.Permanent(errors.New("payload rejected"))
	}
	return nil
}

func contractFailureConfig(blockOnDead bool) outboxconfig.Config {
	cfg := contractConfig()
	cfg.MaxAttempts = 3
	cfg.BackoffBase = 10 * time.Millisecond
	cfg.BackoffMax = 50 * time.Millisecond
	cfg.BlockOnDead = blockOnDead
	return cfg
}

// TestContractFailureRetryAndDeadLetter covers the failure paths with
// block_on_dead=false: a transient failure is retried with backoff, the
// attempts are counted, max_attempts and permanent errors lead to DEAD with
// a JOB_DEAD_LETTER log line and job_dlq_total, and healthy aggregates (and
// the dead event's own successor) keep flowing.
func TestContractFailureRetryAndDeadLetter(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	rec := newContractRecordingSink(contractFailingBehaviour)
	log, logs := contractJSONLogger(t)
	reg := prometheus.NewRegistry()

	// The failing events come first, so every batch that claims healthy
	// events also claims (or retries) them.
	flaky := contractAppend(t, db.Pool, "flaky", contractFlaky)
	poison := contractAppend(t, db.Pool, "poison", contractPoison)
	poisonNext := contractAppend(t, db.Pool, "poison", "order.after-poison")
	perm := contractAppend(t, db.Pool, "perm", contractPerm)
	var healthy []string
	for i := range 300 {
		healthy = append(healthy, contractAppend(t, db.Pool, fmt.Sprintf("ok-%d", i%10), "order.ok"))
	}

	contractStartRelay(t, db.Pool, rec, contractFailureConfig(false), "relay", log, reg)
	testkit.Eventually(t, 20*time.Second, "every event finished", func() bool {
		return contractCountStatus(t, db.Pool, outbox.StatusPublished)+contractCountStatus(t, db.Pool, outbox.StatusDead) == 304
	})

	// Transient twice, then success: PUBLISHED on the third attempt,
	// delivered once, and each call told the sink how many attempts came
	// before. A published event keeps no attempts, so the sink tells.
	if r := contractRowOf(t, db.Pool, flaky); r.Status != outbox.StatusPublished || rec.publishedOnAttempt(flaky) != 3 {
		t.Errorf("flaky event: status %s, published on attempt %d, want PUBLISHED on attempt 3", r.Status, rec.publishedOnAttempt(flaky))
	}
	if n := rec.deliveredCount(flaky); n != 1 {
		t.Errorf("flaky event delivered %d times, want 1", n)
	}
	var flakyAttempts []int
	for _, e := range rec.allCalls() {
		if e.EventID == flaky {
			flakyAttempts = append(flakyAttempts, e.Attempts)
		}
	}
	if !slices.Equal(flakyAttempts, []int{0, 1, 2}) {
		t.Errorf("flaky event: Event.Attempts per call %v, want [0 1 2]", flakyAttempts)
	}

	// Always failing: DEAD after max_attempts.
	if r := contractRowOf(t, db.Pool, poison); r.Status != outbox.StatusDead || r.Attempts != 3 {
		t.Errorf("poison event: status %s attempts %d, want DEAD with attempts 3", r.Status, r.Attempts)
	}
	if n := rec.callCount(poison); n != 3 {
		t.Errorf("poison event: %d publish calls, want 3 (max_attempts)", n)
	}
	// Permanent: DEAD at once.
	if r := contractRowOf(t, db.Pool, perm); r.Status != outbox.StatusDead || r.Attempts != 1 {
		t.Errorf("permanent failure: status %s attempts %d, want DEAD with attempts 1", r.Status, r.Attempts)
	}
	if n := rec.callCount(perm); n != 1 {
		t.Errorf("permanent failure: %d publish calls, want 1", n)
	}

	// block_on_dead=false: the dead event's successor is published, after
	// the dead event's last attempt, never before.
	if r := contractRowOf(t, db.Pool, poisonNext); r.Status != outbox.StatusPublished {
		t.Errorf("successor of a DEAD event: status %s, want PUBLISHED (block_on_dead=false)", r.Status)
	}
	calls := rec.allCalls()
	idx := func(id string, last bool) int {
		pos := -1
		for i, e := range calls {
			if e.EventID == id {
				pos = i
				if !last {
					break
				}
			}
		}
		return pos
	}
	firstPoison, lastPoison, next := idx(poison, false), idx(poison, true), idx(poisonNext, false)
	if next < lastPoison {
		t.Errorf("successor handed to the sink (call #%d) before the poison event's last attempt (call #%d)", next, lastPoison)
	}

	// Healthy aggregates: all published exactly once, on their one and
	// only attempt (one Publish call each), and they flowed while the
	// poison event was being retried.
	for _, id := range healthy {
		r := contractRowOf(t, db.Pool, id)
		if r.Status != outbox.StatusPublished || rec.callCount(id) != 1 || rec.deliveredCount(id) != 1 || rec.publishedOnAttempt(id) != 1 {
			t.Errorf("healthy event %s: status %s, %d Publish calls, delivered %d, on attempt %d; want PUBLISHED once, on attempt 1",
				id, r.Status, rec.callCount(id), rec.deliveredCount(id), rec.publishedOnAttempt(id))
		}
	}
	during := 0
	for i := firstPoison + 1; i < lastPoison; i++ {
		if calls[i].EventType == "order.ok" {
			during++
		}
	}
	if during == 0 {
		t.Error("no healthy event was published while the poison event was retried")
	}
	t.Logf("%d healthy events published between the poison event's first and last attempt", during)

	// Metrics: two dead letters, four scheduled retries (flaky 2 + poison 2).
	testkit.Eventually(t, 5*time.Second, "job_dlq_total to count both dead letters", func() bool {
		return contractMetric(t, reg, "job_dlq_total", map[string]string{"job_name": outbox.RelayJobName}) == 2
	})
	if got := contractMetric(t, reg, "job_retry_total", map[string]string{"job_name": outbox.RelayJobName, "outcome": "scheduled"}); got != 4 {
		t.Errorf(`job_retry_total{job_name="outbox-relay",outcome="scheduled"} = %v, want 4`, got)
	}

	// Each dead letter is logged with its code and event_id.
	for _, id := range []string{poison, perm} {
		found := false
		for _, l := range logs.Lines(t, "") {
			if l["error.code"] == obs.CodeJobDeadLetter && l["event_id"] == id {
				found = true
				if l["job"] != outbox.RelayJobName {
					t.Errorf("dead-letter log line of %s has job %v, want %s", id, l["job"], outbox.RelayJobName)
				}
			}
		}
		if !found {
			t.Errorf("no log line with error.code=%s and event_id=%s", obs.CodeJobDeadLetter, id)
		}
	}
}

// TestContractFailureBlockOnDead: with block_on_dead=true an aggregate stops
// at its DEAD event: its later events stay PENDING and are never handed to
// the sink, while other aggregates keep flowing. The blocked events
// outnumber several batches, so the oldest unfinished rows are all blocked
// and the relay must look past them.
func TestContractFailureBlockOnDead(t *testing.T) {
	t.Parallel()
	const blockedEvents = 60
	db := pgtest.New(t)
	rec := newContractRecordingSink(contractFailingBehaviour)
	cfg := contractFailureConfig(true)
	cfg.BatchSize = 5
	log, logs := contractJSONLogger(t)
	contractStartRelay(t, db.Pool, rec, cfg, "relay", log, prometheus.NewRegistry())

	poison := contractAppend(t, db.Pool, "poison", contractPoison)
	var blocked []string
	for range blockedEvents {
		blocked = append(blocked, contractAppend(t, db.Pool, "poison", "order.after-poison"))
	}
	testkit.Eventually(t, 10*time.Second, "the poison event DEAD", func() bool {
		return contractStatusOf(t, db.Pool, poison) == outbox.StatusDead
	})

	// Events inserted after the poison went DEAD have larger ids than the
	// blocked ones, so once they are published the relay has had every
	// chance to claim the blocked ones too.
	var later []string
	for i := range 20 {
		later = append(later, contractAppend(t, db.Pool, fmt.Sprintf("ok-%d", i%4), "order.ok"))
	}
	testkit.Eventually(t, 10*time.Second, "other aggregates published past the blocked ones", func() bool {
		for _, id := range later {
			if rec.deliveredCount(id) != 1 {
				return false
			}
		}
		return true
	})
	for i, id := range blocked {
		if r := contractRowOf(t, db.Pool, id); r.Status != outbox.StatusPending || r.Attempts != 0 {
			t.Errorf("event %d behind a DEAD one: status %s attempts %d, want PENDING with attempts 0 (block_on_dead=true)", i, r.Status, r.Attempts)
		}
		if n := rec.callCount(id); n != 0 {
			t.Errorf("event %d behind a DEAD one was handed to the sink %d times", i, n)
		}
	}
	// Only the poison event failed; nothing else may be reported.
	for _, l := range logs.Lines(t, "") {
		if (l["level"] == "WARN" || l["level"] == "ERROR") && l["event_id"] != poison {
			t.Errorf("unexpected %v log line %q (error: %v)", l["level"], l["msg"], l["error"])
		}
	}
}

// contractMetric returns the value of the series name with exactly the
// given labels, or -1 when the series does not exist.
func contractMetric(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	if v, ok := testkit.Metric(t, g, name, labels); ok {
		return v
	}
	return -1
}
