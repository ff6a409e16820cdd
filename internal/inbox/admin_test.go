package inbox_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// idleSource receives nothing: with it, a Runner's only work is its sweep.
type idleSource struct{}

func (idleSource) Run(ctx context.Context, h inbox.Handoff) error {
	h.Up()
	<-ctx.Done()
	return nil
}

// startRunner runs source "test" with h until the test ends.
func startRunner(t *testing.T, db *pgtest.DB, cfg inboxconfig.Config, h inbox.Handler) {
	t.Helper()
	m, err := inbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	src := inboxconfig.SourceConfig{Name: "test", Kind: inboxconfig.KindNATS}
	cfg.Sources = []inboxconfig.SourceConfig{src}
	r := inbox.NewRunner(db.Pool, cfg, []inbox.Part{{Config: src, Source: idleSource{}, Handler: h}}, "replica",
		slog.New(slog.NewTextHandler(os.Stderr, nil)), m)
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := r.Shutdown(ctx); err != nil {
			t.Error(err)
		}
	})
}

// insertFinished writes a row as the consumer leaves it in state (DEAD or
// RECOVERY_REQUIRED), with its body kept.
func insertFinished(t *testing.T, db *pgtest.DB, consumer, msgSource, id, state string, attempts int) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, attempts, order_key, body, last_error, finished_at)
VALUES ($1, $2, $3, $4, $5, 'orders/' || $3, convert_to('{"n":"' || $3 || '"}', 'UTF8'), 'it went wrong', now())`,
		consumer, msgSource, id, state, attempts); err != nil {
		t.Fatal(err)
	}
}

type row struct {
	state, owner, lastError string
	attempts                int
	token                   *int64
	expired, finished       bool
}

func readRow(t *testing.T, db *pgtest.DB, id string) row {
	t.Helper()
	var r row
	if err := db.Pool.QueryRow(context.Background(), `
SELECT state, coalesce(owner, ''), coalesce(last_error, ''), attempts, lease_token,
       coalesce(lease_until <= now(), false), finished_at IS NOT NULL
  FROM inbox_message WHERE msg_id = $1`, id).Scan(&r.state, &r.owner, &r.lastError, &r.attempts, &r.token, &r.expired, &r.finished); err != nil {
		t.Fatal(err)
	}
	return r
}

var audit = slog.New(slog.NewTextHandler(os.Stderr, nil))

// An operator's retry requeues a DEAD message (attempts reset) and a
// RECOVERY_REQUIRED one (attempts kept) under an expired claim of its own;
// a running replica's sweep then runs both from their stored bodies, once.
func TestRetriedMessagesRunBySweep(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `ALTER TABLE work ADD COLUMN attempt int`); err != nil {
		t.Fatal(err)
	}
	work := inbox.SQLHandler{SQL: `INSERT INTO work (id, n, attempt) VALUES (@id, @body_json::jsonb->>'n', @attempt::int)`}
	var broken atomic.Bool
	broken.Store(true)
	h := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if broken.Load() {
			return inbox.Permanent(errors.New("the handler is broken"))
		}
		return work.Handle(ctx, tx, m)
	})

	// A message dead-lettered by a consumer, and one an expired
	// processing lease handed to an operator after two attempts.
	cfg := testConfig()
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	newConsumer(t, db, "a", cfg, h).Process(ctx, []*inbox.Delivery{s.delivery("dead-1", "d")})
	if r := readRow(t, db, "dead-1"); r.state != inbox.StateDead {
		t.Fatalf("dead-1 is %s, want DEAD", r.state)
	}
	insertFinished(t, db, "test", "orders", "stuck-1", inbox.StateRecoveryRequired, 2)
	broken.Store(false)

	if n, err := inbox.RetryDead(ctx, db.Pool, inbox.Selection{ID: "dead-1"}, "alice@host", audit); n != 1 || err != nil {
		t.Fatalf("RetryDead: %d, %v; want 1", n, err)
	}
	if n, err := inbox.RetryRecovery(ctx, db.Pool, inbox.Selection{Source: "test", ID: "stuck-1"}, "alice@host", audit); n != 1 || err != nil {
		t.Fatalf("RetryRecovery: %d, %v; want 1", n, err)
	}
	for id, attempts := range map[string]int{"dead-1": 0, "stuck-1": 2} {
		r := readRow(t, db, id)
		if r.state != inbox.StateReceived || r.owner != inbox.OperatorOwner || r.token == nil || !r.expired || r.finished ||
			r.attempts != attempts || r.lastError == "" {
			t.Fatalf("%s after the retry: %+v; want RECEIVED under an expired operator claim, %d attempts, last_error kept", id, r, attempts)
		}
	}

	startRunner(t, db, cfg, h)
	testkit.Eventually(t, 10*time.Second, "the sweep to process the requeued messages", func() bool {
		return readRow(t, db, "dead-1").state == inbox.StateProcessed && readRow(t, db, "stuck-1").state == inbox.StateProcessed
	})
	for _, want := range []struct {
		id, n   string
		attempt int
	}{{"dead-1", "d", 1}, {"stuck-1", "stuck-1", 3}} {
		var runs, attempt int
		var n string
		if err := db.Pool.QueryRow(ctx, `SELECT count(*), coalesce(max(n), ''), coalesce(max(attempt), 0) FROM work WHERE id = $1`,
			want.id).Scan(&runs, &n, &attempt); err != nil {
			t.Fatal(err)
		}
		if runs != 1 || n != want.n || attempt != want.attempt {
			t.Errorf("%s: work ran %d time(s) with n=%q on attempt %d; want once, n=%q, attempt %d", want.id, runs, n, attempt, want.n, want.attempt)
		}
	}
}

// Each operator function acts on its state only, names what it could not
// find, refuses an id that names several messages, and never retries a
// message that has no key.
func TestOperatorSelection(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	insertFinished(t, db, "orders", "shop", "d1", inbox.StateDead, 3)
	insertFinished(t, db, "orders", "shop", "d2", inbox.StateDead, 3)
	insertFinished(t, db, "payments", "shop", "d2", inbox.StateDead, 3) // the same id from another source
	insertFinished(t, db, "orders", "!unkeyed", "sha256:00", inbox.StateDead, 0)
	insertFinished(t, db, "orders", "shop", "r1", inbox.StateRecoveryRequired, 1)
	insertFinished(t, db, "orders", "shop", "p1", inbox.StateProcessed, 0)
	const who = "bob@host"

	_, err := inbox.RetryDead(ctx, db.Pool, inbox.Selection{ID: "nope"}, who, audit)
	var nf *inbox.NotFoundError
	if !errors.As(err, &nf) || len(nf.Elsewhere) != 0 {
		t.Errorf("retry of an unknown id: %v", err)
	}
	_, err = inbox.PurgeDead(ctx, db.Pool, inbox.Selection{ID: "p1"}, who, audit)
	if !errors.As(err, &nf) || !strings.Contains(err.Error(), "(it is PROCESSED)") {
		t.Errorf("purge of a processed message: %v; want not found, saying it is PROCESSED", err)
	}
	_, err = inbox.ResolveRecovery(ctx, db.Pool, inbox.Selection{ID: "d1"}, who, audit)
	if !errors.As(err, &nf) || !strings.Contains(err.Error(), "(it is DEAD)") {
		t.Errorf("resolve of a dead message: %v", err)
	}
	var amb *inbox.AmbiguousError
	if _, err := inbox.RetryDead(ctx, db.Pool, inbox.Selection{ID: "d2"}, who, audit); !errors.As(err, &amb) || len(amb.Keys) != 2 {
		t.Errorf("retry of an id two sources hold: %v; want ambiguous", err)
	}
	var unkeyed *inbox.UnkeyedError
	if _, err := inbox.RetryDead(ctx, db.Pool, inbox.Selection{ID: "sha256:00"}, who, audit); !errors.As(err, &unkeyed) {
		t.Errorf("retry of a message without a key: %v", err)
	}
	if _, err := inbox.RetryDead(ctx, db.Pool, inbox.Selection{ID: "d1"}, "", audit); err == nil {
		t.Error("a retry without an actor was accepted")
	}

	list, total, err := inbox.List(ctx, db.Pool, inbox.StateDead, inbox.Selection{Source: "orders"}, 2)
	if err != nil || len(list) != 2 || total != 3 {
		t.Fatalf("List DEAD of orders, limit 2: %d of %d, %v; want 2 of 3", len(list), total, err)
	}
	var out bytes.Buffer
	if err := inbox.PrintEntries(&out, inbox.StateDead, list, total); err != nil || !strings.Contains(out.String(), "2 of 3 DEAD messages shown") {
		t.Errorf("PrintEntries:\n%s", out.String())
	}

	st, err := inbox.ReadStats(ctx, db.Pool, []string{"orders", "quiet"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if st.BySource["orders"][inbox.StateDead] != 3 || st.Total(inbox.StateDead) != 4 || st.Total(inbox.StateRecoveryRequired) != 1 ||
		st.BySource["quiet"] == nil || !st.Oldest.IsZero() {
		t.Errorf("stats %+v", st)
	}

	// Every DEAD message of orders: the one without a key stays.
	n, err := inbox.RetryDead(ctx, db.Pool, inbox.Selection{Source: "orders"}, who, audit)
	var left *inbox.UnkeyedLeftError
	if n != 2 || !errors.As(err, &left) || left.Left != 1 {
		t.Errorf("RetryDead --all --source orders: %d, %v; want 2 requeued, 1 left", n, err)
	}
	if r := readRow(t, db, "sha256:00"); r.state != inbox.StateDead {
		t.Errorf("the message without a key is %s", r.state)
	}
	st, err = inbox.ReadStats(ctx, db.Pool, nil, "orders")
	if err != nil || st.OldestSource != "orders" || st.OldestAge < 0 || len(st.BySource) != 1 {
		t.Errorf("stats of orders after the retry: %+v, %v; want the requeued claims as the oldest unfinished", st, err)
	}
	out.Reset()
	if err := inbox.PrintStats(&out, st); err != nil || !strings.Contains(out.String(), "oldest unfinished claim:") {
		t.Errorf("PrintStats:\n%s", out.String())
	}

	if n, err := inbox.ResolveRecovery(ctx, db.Pool, inbox.Selection{}, who, audit); n != 1 || err != nil {
		t.Errorf("ResolveRecovery --all: %d, %v", n, err)
	}
	if r := readRow(t, db, "r1"); r.state != inbox.StateResolved || !r.finished {
		t.Errorf("r1 after resolve: %+v", r)
	}
	if n, err := inbox.PurgeDead(ctx, db.Pool, inbox.Selection{Source: "payments", ID: "d2"}, who, audit); n != 1 || err != nil {
		t.Errorf("PurgeDead of payments' d2: %d, %v", n, err)
	}
	if n, err := inbox.PurgeDead(ctx, db.Pool, inbox.Selection{}, who, audit); n != 1 || err != nil {
		t.Errorf("PurgeDead --all: %d, %v; want the message without a key", n, err)
	}
	var count int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_message`).Scan(&count); err != nil || count != 4 {
		t.Errorf("%d rows left (%v), want 4: d1 and d2 requeued, r1 resolved, p1, and none DEAD", count, err)
	}
}
