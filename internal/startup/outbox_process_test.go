package startup_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// The quick-start path: a running worker with the log sink publishes what
// `worker outbox emit` inserts, and the operator verbs see, requeue and
// purge DEAD events.
func TestOutboxCommandsEndToEnd(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	env := []string{"APP_DATABASE_URL=" + db.URL}
	cli := func(args ...string) string {
		t.Helper()
		p := startWorker(t, env, args...)
		if code := p.exitCode(t, 15*time.Second); code != 0 {
			t.Fatalf("worker %v: exit %d\n%s", args, code, p.out.String())
		}
		return p.out.String()
	}
	w := startWorker(t, env)
	w.waitReady(t, 15*time.Second)

	id := strings.TrimSpace(cli("outbox", "emit", "--aggregate-type", "order", "--aggregate-id", "42",
		"--event-type", "order.paid", "--payload", `{"amount":1200}`))
	if len(id) != 36 {
		t.Fatalf("emit printed %q, want an event_id", id)
	}
	testkit.Eventually(t, 10*time.Second, "the log sink to print the event", func() bool {
		return strings.Contains(w.out.String(), id) && strings.Contains(w.out.String(), `"payload":{"amount": 1200}`)
	})
	// Printed comes before the batch commits the publish.
	testkit.Eventually(t, 10*time.Second, "the event to be PUBLISHED", func() bool { return eventStatus(t, db, id) == "PUBLISHED" })
	if out := cli("outbox", "stats"); !strings.Contains(out, "PUBLISHED") || !strings.Contains(out, "1") {
		t.Errorf("stats:\n%s", out)
	}

	makeDead(t, db, id, "sink said no")
	if out := cli("outbox", "dead", "list"); !strings.Contains(out, id) || !strings.Contains(out, "sink said no") {
		t.Errorf("dead list:\n%s", out)
	}
	if out := cli("outbox", "dead", "retry", id); !strings.Contains(out, "requeued 1") {
		t.Errorf("dead retry:\n%s", out)
	}
	testkit.Eventually(t, 10*time.Second, "the requeued event to be published again", func() bool {
		return strings.Count(w.out.String(), `"event_id":"`+id) >= 2
	})

	// Purge acts only on DEAD events: first the event is published again
	// (not DEAD), so nothing goes; once DEAD, --all purges it.
	testkit.Eventually(t, 10*time.Second, "the requeued event to be PUBLISHED", func() bool { return eventStatus(t, db, id) == "PUBLISHED" })
	if out := cli("outbox", "dead", "purge", "--all"); !strings.Contains(out, "purged 0") {
		t.Errorf("dead purge of a published event:\n%s", out)
	}
	makeDead(t, db, id, "sink said no")
	if out := cli("outbox", "dead", "purge", "--all"); !strings.Contains(out, "purged 1") {
		t.Errorf("dead purge --all:\n%s", out)
	}
	// Purged, the event keeps no delivery row: it is neither DEAD nor to
	// publish, and its envelope goes when its partition is dropped.
	var left int
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM outbox_delivery WHERE id = (SELECT id FROM outbox_event WHERE event_id = $1)`, id).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("purged event still has %d delivery row(s)", left)
	}
}

// makeDead makes the event with event_id id DEAD after 3 attempts with
// lastError, as the relay would have. A published event has no delivery
// row left (it is deleted on publish), so the row is written afresh then.
func makeDead(t *testing.T, db *pgtest.DB, id, lastError string) {
	t.Helper()
	tag, err := db.Pool.Exec(context.Background(), `
INSERT INTO outbox_delivery (id, created_at, aggregate_type, aggregate_id, status, attempts, last_error, dead_at)
SELECT id, created_at, aggregate_type, aggregate_id, 'DEAD', 3, $2, now() FROM outbox_event WHERE event_id = $1
ON CONFLICT (id) DO UPDATE SET status = 'DEAD', attempts = 3, last_error = $2, dead_at = now(), claimed_by = NULL`,
		id, lastError)
	if err != nil {
		t.Fatal(err)
	}
	if tag.RowsAffected() != 1 {
		t.Fatalf("no event with event_id %s to make DEAD", id)
	}
}

// dead list says when it shows only some of the DEAD events and how to see
// the rest; retry and purge of an event that is not DEAD exit 66.
func TestDeadEventCommandsOnWhatIsThere(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	for _, sql := range []string{
		`INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		 SELECT 'order', g::text, 'order.paid', '{}' FROM generate_series(1, 3) g`,
		`UPDATE outbox_delivery SET status = 'DEAD', attempts = 3, last_error = 'sink said no', dead_at = now()`,
	} {
		if _, err := db.Pool.Exec(context.Background(), sql); err != nil {
			t.Fatal(err)
		}
	}
	run := func(want int, args ...string) string {
		t.Helper()
		p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL}, args...)
		if code := p.exitCode(t, 15*time.Second); code != want {
			t.Fatalf("worker %v: exit %d, want %d\n%s", args, code, want, p.out.String())
		}
		return p.out.String()
	}
	if out := run(0, "outbox", "dead", "list", "--limit", "2"); !strings.Contains(out, "2 of 3 DEAD events shown, oldest first; see more with --limit 3") ||
		strings.Count(out, "sink said no") != 2 {
		t.Errorf("dead list --limit 2:\n%s", out)
	}
	if out := run(0, "outbox", "dead", "list"); !strings.Contains(out, "3 DEAD event(s)") || strings.Count(out, "sink said no") != 3 {
		t.Errorf("dead list:\n%s", out)
	}
	const unknown = "0b6a3c5e-2f4d-4e61-9d9a-7c1c2f0e8b11"
	for _, verb := range []string{"retry", "purge"} {
		if out := run(66, "outbox", "dead", verb, unknown); !strings.Contains(out, "no DEAD event with event_id "+unknown) {
			t.Errorf("dead %s of an unknown event:\n%s", verb, out)
		}
	}
	var dead int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event_state WHERE status = 'DEAD'`).Scan(&dead); err != nil || dead != 3 {
		t.Errorf("%d DEAD events left (%v), want the 3 untouched", dead, err)
	}
}

// An event the table's constraints refuse is a bad argument (64) named by
// the constraint, not an internal error.
func TestEmitRefusedByAConstraintExits64(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(),
		`ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_test_rule CHECK (aggregate_id <> 'forbidden')`); err != nil {
		t.Fatal(err)
	}
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL},
		"outbox", "emit", "--aggregate-type", "order", "--aggregate-id", "forbidden", "--event-type", "order.paid")
	if code := p.exitCode(t, 15*time.Second); code != 64 {
		t.Fatalf("exit %d, want 64", code)
	}
	if out := p.out.String(); !strings.Contains(out, "breaks a rule of outbox_event (outbox_event_test_rule)") {
		t.Errorf("message should name the constraint:\n%s", out)
	}
}

func TestEmitBreakingAProducerRuleExits64(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL},
		"outbox", "emit", "--aggregate-type", "order", "--aggregate-id", strings.Repeat("x", 600), "--event-type", "order.paid")
	if code := p.exitCode(t, 15*time.Second); code != 64 {
		t.Fatalf("exit %d, want 64", code)
	}
	if out := p.out.String(); !strings.Contains(out, "breaks a rule of outbox_event (outbox_event_aggregate_id_length)") {
		t.Errorf("message should name the rule:\n%s", out)
	}
}
