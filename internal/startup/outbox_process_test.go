package startup_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"worker/internal/pgtest"
	"worker/internal/testkit"
)

// The quick-start path: a running worker with the log sink publishes what
// `worker outbox emit` inserts, and the operator verbs see, requeue and
// purge DEAD events.
func TestOutboxCommandsEndToEnd(t *testing.T) {
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
		return strings.Contains(w.out.String(), id) && strings.Contains(w.out.String(), `"amount":1200`)
	})
	if out := cli("outbox", "stats"); !strings.Contains(out, "PUBLISHED") || !strings.Contains(out, "1") {
		t.Errorf("stats:\n%s", out)
	}

	if _, err := db.Pool.Exec(context.Background(), `UPDATE outbox_event SET status = 'DEAD', attempts = 3,
		last_error = 'sink said no' WHERE event_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if out := cli("outbox", "dead", "list"); !strings.Contains(out, id) || !strings.Contains(out, "sink said no") {
		t.Errorf("dead list:\n%s", out)
	}
	if out := cli("outbox", "dead", "retry", id); !strings.Contains(out, "requeued 1") {
		t.Errorf("dead retry:\n%s", out)
	}
	testkit.Eventually(t, 10*time.Second, "the requeued event to be published again", func() bool {
		return strings.Count(w.out.String(), `"event_id":"`+id) >= 2
	})

	// Purge deletes only DEAD events: first the event is published (not
	// DEAD), so nothing goes; once DEAD, --all deletes it.
	if out := cli("outbox", "dead", "purge", "--all"); !strings.Contains(out, "purged 0") {
		t.Errorf("dead purge of a published event:\n%s", out)
	}
	if _, err := db.Pool.Exec(context.Background(), `UPDATE outbox_event SET status = 'DEAD' WHERE event_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if out := cli("outbox", "dead", "purge", "--all"); !strings.Contains(out, "purged 1") {
		t.Errorf("dead purge --all:\n%s", out)
	}
	var left int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event WHERE event_id = $1`, id).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("purged event still has %d row(s)", left)
	}
}
