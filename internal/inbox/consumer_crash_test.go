package inbox_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// A transactional handler's holder stopped mid-work: its claim, work and
// PROCESSED were one transaction, which the server ends (idle in
// transaction past a third of the lease), so the redelivery simply runs
// the message, once, and nothing waits for an operator.
func TestTransactionalCrashRunsAgain(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	cfg := testConfig()
	cfg.LeaseTTL = time.Second
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	stuck := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if err := countWork.Handle(ctx, tx, m); err != nil {
			return err
		}
		entered <- struct{}{}
		<-release
		return nil
	})
	a := newConsumer(t, db, "a", cfg, stuck)
	b := newConsumer(t, db, "b", cfg, countWork)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	done := make(chan struct{})
	go func() {
		a.Process(ctx, []*inbox.Delivery{s.delivery("m-1", "k")})
		close(done)
	}()
	<-entered
	// b gets the redelivery while a is stuck: its claim waits for a's
	// transaction to end, then finds nothing committed and runs it.
	b.Process(ctx, []*inbox.Delivery{s.delivery("m-1", "k")})
	close(release)
	<-done
	if n, st := workCount(t, db, "m-1"), state(t, db, "m-1"); n != 1 || st != inbox.StateProcessed {
		t.Fatalf("work applied %d times, state %s; want once and PROCESSED", n, st)
	}
	// b's claim ran it; a's transaction was ended, and a's retry of it
	// found it done.
	if got := fmt.Sprint(s.of("m-1")); got != "[processed duplicate]" {
		t.Fatalf("settled %s; want processed (b), then a duplicate (a's retry)", got)
	}
}

// Concurrent duplicates under a transactional handler: the row lock on the
// dedupe key serializes them, so each message's work is done once, and
// every other delivery is a duplicate.
func TestConcurrentDuplicatesWorkOnce(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	var wg sync.WaitGroup
	for r := range 4 {
		c := newConsumer(t, db, "r"+strconv.Itoa(r), testConfig(), countWork)
		wg.Go(func() {
			var batch []*inbox.Delivery
			for i := range 50 {
				batch = append(batch, s.delivery(strconv.Itoa(i), strconv.Itoa(i)))
			}
			c.Process(ctx, batch)
		})
	}
	wg.Wait()
	var total, distinct int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT id) FROM work`).Scan(&total, &distinct); err != nil {
		t.Fatal(err)
	}
	if total != 50 || distinct != 50 {
		t.Fatalf("%d pieces of work for %d messages; want 50 for 50", total, distinct)
	}
	for i := range 50 {
		got := s.of(strconv.Itoa(i))
		processed := 0
		for _, o := range got {
			if o == inbox.Processed {
				processed++
			}
		}
		if processed != 1 {
			t.Fatalf("message %d settled %v; want processed once", i, got)
		}
	}
}

// Replicas claiming the same duplicate keys, each batch in an order of its
// own, never deadlock: every claim locks its keys in one order. The
// database's own count of deadlocks stays where it was, and no inbox
// transaction fails with SQLSTATE 40P01.
func TestClaimsNeverDeadlock(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, 4+pgtest.PoolConns)
	db := workDB(t)
	ctx := context.Background()
	deadlocks := func() int64 {
		var n int64
		if err := db.Pool.QueryRow(ctx, `SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := deadlocks()
	// The racers have a pool of their own, closed at the end: a backend
	// flushes its statistics when it exits.
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.RuntimeParams["application_name"] = "deadlock-racer"
	release := pgtest.Reserve(t, 4)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	var logs testkit.LogBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	cfg := testConfig()
	cfg.LeaseTTL = 10 * time.Second
	const keys, racers, rounds = 60, 4, 5
	var wg sync.WaitGroup
	for r := range racers {
		m, err := inbox.NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		// Unordered: the order keys are all different, and one lane.
		src := inboxconfig.SourceConfig{Name: "test", Kind: inboxconfig.KindNATS, Concurrency: 1}
		c := inbox.NewConsumer(pool, src, cfg, countWork, "r"+strconv.Itoa(r), log, m)
		wg.Go(func() {
			for round := range rounds {
				ids := rand.Perm(keys)
				batch := make([]*inbox.Delivery, len(ids))
				for n, i := range ids {
					id := strconv.Itoa(round*keys + i)
					batch[n] = &inbox.Delivery{Message: inbox.Message{Source: "orders", ID: id, OrderKey: "orders/" + id, Body: []byte(`{}`)}}
				}
				c.Process(ctx, batch)
			}
		})
	}
	wg.Wait()
	pool.Close()
	release()
	testkit.Eventually(t, 10*time.Second, "the racers' sessions to end", func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'deadlock-racer'`).Scan(&n)
		return n == 0
	})
	if bytes.Contains([]byte(logs.String()), []byte("40P01")) {
		t.Fatalf("an inbox transaction deadlocked:\n%s", logs.String())
	}
	if d := deadlocks() - before; d != 0 {
		t.Fatalf("pg_stat_database counted %d deadlocks during the race; want 0", d)
	}
	var total, distinct int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT id) FROM work`).Scan(&total, &distinct); err != nil {
		t.Fatal(err)
	}
	if total != keys*rounds || distinct != keys*rounds {
		t.Fatalf("%d pieces of work for %d messages; want %d, once each", total, distinct, keys*rounds)
	}
}

// A message the database cannot store (a NUL byte or bytes that are not
// UTF-8 in its id, subject or a header) is DEAD at once with its reason,
// visible to an operator and counted, and the ordered messages of the
// same batch go ahead in order.
func TestUnstorableDeadAtOnce(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	m, err := inbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	c := inbox.NewConsumer(db.Pool, inboxconfig.SourceConfig{Name: "test", Kind: inboxconfig.KindRabbitMQ}, testConfig(), countWork, "a", nil, m)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	nulHeader := s.delivery("h-1", "a")
	nulHeader.Message.Headers = map[string]string{"x-note": "a\x00b"}
	badID := s.delivery("nul\x00id", "b")
	badSubject := s.delivery("s-1", "a")
	badSubject.Message.OrderKey = "orders/\xff\xfe"
	badHeaderName := s.delivery("h-2", "b")
	badHeaderName.Message.Headers = map[string]string{"x-\xc3": "v"}
	batch := []*inbox.Delivery{
		s.delivery("a-1", "a"), s.delivery("b-1", "b"), nulHeader, badID,
		s.delivery("a-2", "a"), badSubject, s.delivery("b-2", "b"), badHeaderName, s.delivery("a-3", "a"),
	}
	c.Process(ctx, batch)
	rows, err := db.Pool.Query(ctx, `SELECT id FROM work ORDER BY at`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(ids) != "[a-1 b-1 a-2 b-2 a-3]" {
		t.Fatalf("work applied %v; want every storable message once, in order", ids)
	}
	for _, id := range []string{"h-1", "nul\x00id", "s-1", "h-2"} {
		if got := fmt.Sprint(s.of(id)); got != "[dead]" {
			t.Errorf("%q settled %s; want dead at once", id, got)
		}
	}
	list, total, err := inbox.List(ctx, db.Pool, inbox.StateDead, inbox.Selection{}, 10)
	if err != nil || total != 4 {
		t.Fatalf("dead list: %d (%v); want the 4 unstorable messages", total, err)
	}
	for _, e := range list {
		if !bytes.Contains([]byte(e.LastError), []byte("unstorable message")) {
			t.Errorf("dead %s: reason %q; want why it could not be stored", e.ID, e.LastError)
		}
	}
	stats, err := inbox.ReadStats(ctx, db.Pool, []string{"test"}, "")
	if err != nil || stats.Total(inbox.StateDead) != 4 {
		t.Fatalf("stats show %d DEAD (%v); want 4", stats.Total(inbox.StateDead), err)
	}
	if n, _ := testkit.Metric(t, reg, "inbox_unstorable_total", map[string]string{"source": "test"}); n != 4 {
		t.Fatalf("inbox_unstorable_total = %v; want 4", n)
	}
	// Its redelivery is a duplicate of the dead letter, not a new one.
	again := s.delivery("nul\x00id", "b")
	c.Process(ctx, []*inbox.Delivery{again})
	if got := fmt.Sprint(s.of("nul\x00id")); got != "[dead duplicate]" || again.Found != inbox.StateDead {
		t.Fatalf("the redelivery settled %s (found %q); want a duplicate of the DEAD row", got, again.Found)
	}
}

// A batch split into lanes works them at once, on several connections,
// and keeps each order key's messages in the source's order.
func TestLanesKeepOrder(t *testing.T) {
	t.Parallel()
	db := workDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `ALTER TABLE work ADD COLUMN pid int DEFAULT pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	src := inboxconfig.SourceConfig{Name: "test", Kind: inboxconfig.KindKafka, Concurrency: 4}
	c := newConsumerOf(t, db, "a", testConfig(), countWork, src)
	s := &settled{outcomes: map[string][]inbox.Outcome{}}
	for round := range 3 {
		var batch []*inbox.Delivery
		for i := range 100 {
			d := s.delivery(fmt.Sprintf("%d-%d", round, i), strconv.Itoa(round*100+i))
			d.Message.OrderKey = "orders/k" + strconv.Itoa(i%10)
			batch = append(batch, d)
		}
		c.Process(ctx, batch)
	}
	var total, pids, backwards int
	if err := db.Pool.QueryRow(ctx, `
		SELECT count(*), count(DISTINCT pid), count(*) FILTER (WHERE back) FROM (
		  SELECT pid, n::int < lag(n::int) OVER (PARTITION BY n::int % 10 ORDER BY at) AS back FROM work) w`).Scan(&total, &pids, &backwards); err != nil {
		t.Fatal(err)
	}
	if total != 300 || backwards != 0 {
		t.Fatalf("%d pieces of work, %d out of their key's order; want 300 in order", total, backwards)
	}
	if pids < 2 {
		t.Fatalf("the work ran on %d connection(s); want the lanes on several", pids)
	}
}
