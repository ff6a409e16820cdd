package startup_test

import (
	"context"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/pgtest"
)

// The inbox's operator commands, through the binary, on rows as the
// consumer leaves them: what they print, what they change, who they log,
// and their exit codes. That a requeued message is then processed by a
// running replica's sweep is TestRetriedMessagesRunBySweep's (package
// inbox): no source kind is built into the binary to start one here.
func TestInboxCommandsEndToEnd(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, attempts, body, last_error, finished_at)
VALUES ('orders', 'shop', 'm-dead', 'DEAD', 3, '\x7b7d', 'handler said no', now()),
       ('orders', 'shop', 'm-other', 'DEAD', 1, '\x7b7d', 'permanent: bad amount', now()),
       ('orders', 'shop', 'm-stuck', 'RECOVERY_REQUIRED', 1, '\x7b7d', 'the processing lease of r1 expired', now()),
       ('orders', 'shop', 'm-done', 'PROCESSED', 0, NULL, NULL, now())`); err != nil {
		t.Fatal(err)
	}
	env := []string{"APP_DATABASE_URL=" + db.URL}
	run := func(want int, args ...string) (stdout, stderr string) {
		t.Helper()
		code, stdout, stderr := runCLI(t, env, args...)
		if code != want {
			t.Fatalf("worker %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, want, stdout, stderr)
		}
		return stdout, stderr
	}

	if out, _ := run(0, "inbox", "stats"); !strings.Contains(out, "orders") || !strings.Contains(out, "DEAD: 2") ||
		!strings.Contains(out, "RECOVERY_REQUIRED: 1") || !strings.Contains(out, "oldest unfinished claim: none") {
		t.Errorf("inbox stats:\n%s", out)
	}
	if out, _ := run(0, "inbox", "dead", "list", "--source", "orders", "--limit", "1"); !strings.Contains(out, "m-dead") ||
		!strings.Contains(out, "handler said no") || !strings.Contains(out, "1 of 2 DEAD messages shown") {
		t.Errorf("inbox dead list --limit 1:\n%s", out)
	}
	if out, _ := run(0, "inbox", "recovery", "list", "--output", "json"); !strings.Contains(out, `"msg_id": "m-stuck"`) || !strings.Contains(out, `"body": {}`) {
		t.Errorf("inbox recovery list --output json:\n%s", out)
	}

	out, stderr := run(0, "inbox", "dead", "retry", "m-dead")
	if !strings.Contains(out, "requeued 1 message(s)") {
		t.Errorf("inbox dead retry:\n%s", out)
	}
	if !strings.Contains(stderr, `"msg":"inbox dead messages requeued"`) || !strings.Contains(stderr, `"actor":"`) || !strings.Contains(stderr, `"msg_id":"m-dead"`) {
		t.Errorf("no audit line naming the operator and the message:\n%s", stderr)
	}
	var state, owner string
	var attempts int
	var expired bool
	if err := db.Pool.QueryRow(ctx, `SELECT state, owner, attempts, lease_until <= now() FROM inbox_message WHERE msg_id = 'm-dead'`).
		Scan(&state, &owner, &attempts, &expired); err != nil {
		t.Fatal(err)
	}
	if state != "RECEIVED" || owner != "operator" || attempts != 0 || !expired {
		t.Errorf("m-dead after the retry: %s, owner %s, %d attempts, lease expired %v; want RECEIVED under an expired operator claim, 0 attempts",
			state, owner, attempts, expired)
	}
	if out, _ := run(0, "inbox", "stats", "--source", "orders"); !strings.Contains(out, "DEAD: 1") || strings.Contains(out, "unfinished claim: none") {
		t.Errorf("inbox stats after the retry:\n%s", out)
	}

	// A message not in the command's state is "no such item"; one already
	// retried is no longer DEAD.
	for _, args := range [][]string{
		{"inbox", "dead", "retry", "m-nope"},
		{"inbox", "dead", "retry", "m-dead"},
		{"inbox", "dead", "purge", "m-done"},
		{"inbox", "recovery", "resolve", "m-other"},
		{"inbox", "dead", "retry", "--source", "payments", "m-other"},
	} {
		_, stderr := run(66, args...)
		if !strings.Contains(stderr, "no ") || !strings.Contains(stderr, "worker inbox") {
			t.Errorf("worker %s: the message should say what is missing and which list shows them:\n%s", strings.Join(args, " "), stderr)
		}
	}
	if _, stderr := run(66, "inbox", "dead", "purge", "m-done"); !strings.Contains(stderr, "(it is PROCESSED)") {
		t.Errorf("purge of a processed message does not say its state:\n%s", stderr)
	}
	if _, stderr := run(64, "inbox", "dead", "retry", "--all", "m-other"); !strings.Contains(stderr, "exactly one of <msg_id> or --all") {
		t.Errorf("an id and --all:\n%s", stderr)
	}
	run(64, "inbox", "recovery", "resolve")
	run(64, "inbox", "dead", "list", "--limit", "0")

	if out, _ := run(0, "inbox", "recovery", "resolve", "--all"); !strings.Contains(out, "resolved 1 message(s)") {
		t.Errorf("inbox recovery resolve --all:\n%s", out)
	}
	if out, _ := run(0, "inbox", "dead", "purge", "--all", "--source", "orders"); !strings.Contains(out, "purged 1 message(s)") {
		t.Errorf("inbox dead purge --all:\n%s", out)
	}
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_message WHERE state IN ('DEAD', 'RECOVERY_REQUIRED')`).Scan(&left); err != nil || left != 0 {
		t.Errorf("%d messages still wait for an operator (%v), want 0", left, err)
	}
}
