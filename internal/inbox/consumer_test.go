package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/pgtest"
)

// settled records what the consumer told the source.
type settled struct {
	mu       sync.Mutex
	outcomes map[string][]inbox.Outcome
}

func (s *settled) delivery(id string, body string) *inbox.Delivery {
	return &inbox.Delivery{
		Message: inbox.Message{Source: "orders", ID: id, OrderKey: "orders/" + body, Body: []byte(`{"n":"` + body + `"}`)},
		Settle: func(_ context.Context, o inbox.Outcome, _ time.Duration) error {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.outcomes[id] = append(s.outcomes[id], o)
			return nil
		},
	}
}

func (s *settled) of(id string) []inbox.Outcome {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]inbox.Outcome(nil), s.outcomes[id]...)
}

func testConfig() inboxconfig.Config {
	cfg := inboxconfig.DefaultConfig()
	cfg.BackoffBase, cfg.BackoffMax = time.Millisecond, 5*time.Millisecond
	cfg.LeaseTTL = 2 * time.Second
	return cfg
}

// newConsumer returns a consumer on its own database whose sql handler
// counts each message's work in the table work.
func newConsumer(t *testing.T, db *pgtest.DB, owner string, cfg inboxconfig.Config, h inbox.Handler) *inbox.Consumer {
	t.Helper()
	return newConsumerOf(t, db, owner, cfg, h, inboxconfig.SourceConfig{Name: "test", Kind: inboxconfig.KindNATS})
}

// newConsumerOf is newConsumer of source src.
func newConsumerOf(t *testing.T, db *pgtest.DB, owner string, cfg inboxconfig.Config, h inbox.Handler, src inboxconfig.SourceConfig) *inbox.Consumer {
	t.Helper()
	m, err := inbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return inbox.NewConsumer(db.Pool, src, cfg, h, owner, slog.New(slog.NewTextHandler(os.Stderr, nil)), m)
}

// external is the test source with a handler declared to act outside the
// work transaction.
var external = inboxconfig.SourceConfig{Name: "test", Kind: inboxconfig.KindNATS, Effects: inboxconfig.EffectsExternal}

func workDB(t *testing.T) *pgtest.DB {
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE work (id text, n text, at serial)`); err != nil {
		t.Fatal(err)
	}
	return db
}

var countWork = inbox.SQLHandler{SQL: `INSERT INTO work (id, n) VALUES (@id, @body_json::jsonb->>'n')`}

func workCount(t *testing.T, db *pgtest.DB, id string) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM work WHERE id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func state(t *testing.T, db *pgtest.DB, id string) string {
	t.Helper()
	var s string
	if err := db.Pool.QueryRow(context.Background(), `SELECT state FROM inbox_message WHERE msg_id = $1`, id).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestProcessedOnceAndDuplicatesAcked(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	c := newConsumer(t, db, "a", testConfig(), countWork)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	ctx := context.Background()
	// The same id twice in one batch, and again in a later batch.
	c.Process(ctx, []*inbox.Delivery{s.delivery("1", "x"), s.delivery("2", "y"), s.delivery("1", "x")})
	c.Process(ctx, []*inbox.Delivery{s.delivery("1", "x")})
	if n := workCount(t, db, "1"); n != 1 {
		t.Fatalf("message 1's work ran %d times, want 1", n)
	}
	if got := s.of("1"); fmt.Sprint(got) != "[processed duplicate duplicate]" {
		t.Fatalf("message 1 settled %v", got)
	}
	if st := state(t, db, "2"); st != "PROCESSED" {
		t.Fatalf("message 2 is %s", st)
	}
}

// A message whose work succeeds at its first try has its row written
// once, already PROCESSED: its claim and work commit together, so the row
// needs no body stored for a retry and no second write to clear it. A
// batch with a failure rolls back and claims again the long way, and its
// messages still end as they should.
func TestFirstTryWritesItsRowOnce(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
		CREATE TABLE row_writes (msg_id text, state text);
		CREATE FUNCTION log_row_write() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO row_writes VALUES (NEW.msg_id, NEW.state); RETURN NEW; END $$;
		CREATE TRIGGER log_row_write AFTER INSERT OR UPDATE ON inbox_message FOR EACH ROW EXECUTE FUNCTION log_row_write();
		CREATE TABLE work_fails (n text);
		INSERT INTO work_fails VALUES ('boom');
		CREATE FUNCTION work_ok(n text) RETURNS text LANGUAGE plpgsql AS $$
		BEGIN IF EXISTS (SELECT FROM work_fails f WHERE f.n = work_ok.n) THEN RAISE EXCEPTION 'no'; END IF; RETURN n; END $$`); err != nil {
		t.Fatal(err)
	}
	h := inbox.SQLHandler{SQL: `INSERT INTO work (id, n) VALUES (@id, work_ok(@body_json::jsonb->>'n'))`}
	c := newConsumer(t, db, "a", testConfig(), h)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	c.Process(ctx, []*inbox.Delivery{s.delivery("1", "x"), s.delivery("2", "y")})
	writes := func(id string) string {
		t.Helper()
		var w string
		if err := db.Pool.QueryRow(ctx, `SELECT coalesce(string_agg(state, ' ' ORDER BY ctid), '') FROM row_writes WHERE msg_id = $1`, id).Scan(&w); err != nil {
			t.Fatal(err)
		}
		return w
	}
	for _, id := range []string{"1", "2"} {
		if w := writes(id); w != "PROCESSED" || workCount(t, db, id) != 1 {
			t.Fatalf("message %s: row writes %q, work %d; want one write, PROCESSED, and its work once", id, w, workCount(t, db, id))
		}
	}

	// "boom" fails: the batch rolls back and runs again with a savepoint
	// each, claiming the long way.
	c.Process(ctx, []*inbox.Delivery{s.delivery("3", "z"), s.delivery("4", "boom")})
	if workCount(t, db, "3") != 1 || state(t, db, "3") != "PROCESSED" || state(t, db, "4") != "DEAD" {
		t.Fatalf("after a failure: 3 worked %d times and is %s, 4 is %s; want 3 PROCESSED once and 4 DEAD after its retries",
			workCount(t, db, "3"), state(t, db, "3"), state(t, db, "4"))
	}
	var body string
	if err := db.Pool.QueryRow(ctx, `SELECT convert_from(body, 'UTF8') FROM inbox_message WHERE msg_id = '4'`).Scan(&body); err != nil || body != `{"n":"boom"}` {
		t.Fatalf("the dead message's body is %q (%v); want it kept for an operator", body, err)
	}
}

func TestFailureRetriedThenDead(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	var calls sync.Map
	h := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		n, _ := calls.LoadOrStore(m.ID, new(int))
		*n.(*int)++
		switch m.ID {
		case "flaky":
			if m.Attempt < 2 {
				return errors.New("not yet")
			}
		case "bad":
			return errors.New("always")
		}
		return countWork.Handle(ctx, tx, m)
	})
	cfg := testConfig()
	c := newConsumer(t, db, "a", cfg, h)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	c.Process(context.Background(), []*inbox.Delivery{s.delivery("ok", "a"), s.delivery("flaky", "b"), s.delivery("bad", "c")})
	if workCount(t, db, "ok") != 1 || workCount(t, db, "flaky") != 1 || workCount(t, db, "bad") != 0 {
		t.Fatal("work not applied once for ok and flaky, never for bad")
	}
	if st := state(t, db, "bad"); st != "DEAD" {
		t.Fatalf("bad is %s, want DEAD after %d attempts", st, cfg.MaxAttempts)
	}
	if got := s.of("bad"); fmt.Sprint(got) != "[dead]" {
		t.Fatalf("bad settled %v", got)
	}
	if n, _ := calls.Load("bad"); *n.(*int) < cfg.MaxAttempts {
		t.Fatalf("bad tried %d times", *n.(*int))
	}
}

func TestOrderKeyHeldBehindFailure(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	failed := false
	h := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if m.ID == "1" && !failed {
			failed = true
			return errors.New("once")
		}
		return countWork.Handle(ctx, tx, m)
	})
	c := newConsumer(t, db, "a", testConfig(), h)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	// 1 and 2 share an order key: 2 must not be applied before 1.
	c.Process(context.Background(), []*inbox.Delivery{s.delivery("1", "k"), s.delivery("2", "k")})
	var ids []string
	rows, _ := db.Pool.Query(context.Background(), `SELECT id FROM work ORDER BY at`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(ids) != "[1 2]" {
		t.Fatalf("work order %v, want [1 2]", ids)
	}
}

func TestUnkeyedDeadLettered(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	c := newConsumer(t, db, "a", testConfig(), countWork)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	d := s.delivery("", "z")
	c.Process(context.Background(), []*inbox.Delivery{d})
	c.Process(context.Background(), []*inbox.Delivery{s.delivery("", "z")})
	var n int
	var reason string
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT count(*), max(last_error) FROM inbox_message WHERE state = 'DEAD'`).Scan(&n, &reason); err != nil {
		t.Fatal(err)
	}
	if n != 1 || reason == "" {
		t.Fatalf("%d DEAD rows (reason %q), want 1 with a reason", n, reason)
	}
	if got := s.of(""); fmt.Sprint(got) != "[dead duplicate]" {
		t.Fatalf("settled %v", got)
	}
}

// A claim whose holder stopped before its work began (RECEIVED) is taken
// over once its lease expires; one whose work began (PROCESSING) under a
// handler with external effects goes to an operator, with the cut-off try
// counted as an attempt, and its holder's late commit is refused.
func TestExpiredLeases(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	cfg := testConfig()
	cfg.LeaseTTL = time.Second
	// A handler that stops the first holder mid-work until released.
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	slow := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if m.ID == "stuck" {
			entered <- struct{}{}
			<-release
		}
		return countWork.Handle(ctx, tx, m)
	})
	a := newConsumerOf(t, db, "a", cfg, slow, external)
	b := newConsumerOf(t, db, "b", cfg, countWork, external)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}

	// RECEIVED by a dead replica: insert the claim as a receive would.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_message (consumer, msg_source, msg_id, owner, lease_token, lease_until)
		VALUES ('test', 'orders', 'orphan', 'gone', 1, now() - interval '1 second')`); err != nil {
		t.Fatal(err)
	}
	b.Process(ctx, []*inbox.Delivery{s.delivery("orphan", "o")})
	if workCount(t, db, "orphan") != 1 || state(t, db, "orphan") != "PROCESSED" {
		t.Fatal("an expired RECEIVED claim was not taken over")
	}

	done := make(chan struct{})
	go func() {
		a.Process(ctx, []*inbox.Delivery{s.delivery("stuck", "s")})
		close(done)
	}()
	<-entered
	// a's lease expires while its work runs; b gets the redelivery.
	deadline := time.Now().Add(10 * time.Second)
	for state(t, db, "stuck") != "RECOVERY_REQUIRED" {
		if time.Now().After(deadline) {
			t.Fatal("the expired PROCESSING claim never went to RECOVERY_REQUIRED")
		}
		b.Process(ctx, []*inbox.Delivery{s.delivery("stuck", "s")})
		time.Sleep(100 * time.Millisecond)
	}
	close(release)
	<-done
	if n := workCount(t, db, "stuck"); n != 0 {
		t.Fatalf("the stuck message's work committed %d times after its lease expired, want 0", n)
	}
	list, _, err := inbox.List(ctx, db.Pool, inbox.StateRecoveryRequired, inbox.Selection{}, 10)
	if err != nil || len(list) != 1 || list[0].Attempts != 1 {
		t.Fatalf("recovery list %+v (%v); want the stuck message with the 1 attempt it had", list, err)
	}
}

// A message whose earlier message of the same order key is busy (another
// replica holds it) waits too, instead of overtaking it.
func TestBehindABusyMessageWaits(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	c := newConsumer(t, db, "a", testConfig(), countWork)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	// "1" is held by replica b, its lease live.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_message (consumer, msg_source, msg_id, owner, lease_token, lease_until)
		VALUES ('test', 'orders', '1', 'b', 1, now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	c.Process(ctx, []*inbox.Delivery{s.delivery("1", "k"), s.delivery("2", "k"), s.delivery("3", "other")})
	if fmt.Sprint(s.of("1"), s.of("2"), s.of("3")) != "[busy] [busy] [processed]" {
		t.Fatalf("settled %v %v %v; want 2 to wait behind the busy 1", s.of("1"), s.of("2"), s.of("3"))
	}
	if workCount(t, db, "2") != 0 {
		t.Fatal("2 overtook 1")
	}
	// Let go, 2 keeps what a takeover runs it from: the sweep may have to,
	// if its source never delivers it again.
	var st, body string
	var expired bool
	if err := db.Pool.QueryRow(ctx, `SELECT state, convert_from(body, 'UTF8'), lease_until <= now() FROM inbox_message WHERE msg_id = '2'`).Scan(&st, &body, &expired); err != nil {
		t.Fatal(err)
	}
	if st != "RECEIVED" || body != `{"n":"k"}` || !expired {
		t.Fatalf("2 is %s with body %q, lease expired %v; want RECEIVED, its body kept and its lease ended", st, body, expired)
	}
	// 2's claim was let go: its next delivery runs it once 1 is done.
	if _, err := db.Pool.Exec(ctx, `UPDATE inbox_message SET state = 'PROCESSED', finished_at = now(), owner = NULL, lease_token = NULL, lease_until = NULL WHERE msg_id = '1'`); err != nil {
		t.Fatal(err)
	}
	c.Process(ctx, []*inbox.Delivery{s.delivery("2", "k")})
	if workCount(t, db, "2") != 1 {
		t.Fatal("2 was not run on its next delivery")
	}
}

// A Go handler writes its outgoing events with outbox.Append in the work
// transaction: they commit with the message's claim, once, and roll back
// with a failed attempt.
func TestGoHandlerAppendsToTheOutbox(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	tries := 0
	h := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if _, err := outbox.Append(ctx, tx, outbox.NewEvent{AggregateType: "receipt", AggregateID: m.ID, EventType: "receipt.sent", Payload: m.Body}); err != nil {
			return err
		}
		if tries++; tries == 1 {
			return errors.New("the first attempt fails after its append")
		}
		return nil
	})
	c := newConsumer(t, db, "a", testConfig(), h)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	c.Process(ctx, []*inbox.Delivery{s.delivery("order-1", "x")})
	c.Process(ctx, []*inbox.Delivery{s.delivery("order-1", "x")})
	var events int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event WHERE aggregate_id = 'order-1'`).Scan(&events); err != nil {
		t.Fatal(err)
	}
	if events != 1 || fmt.Sprint(s.of("order-1")) != "[processed duplicate]" {
		t.Fatalf("%d outgoing events, settled %v; want 1 event, processed then duplicate", events, s.of("order-1"))
	}
}
