package nats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/outbox/sink"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestExactlyOnce: a backlog over several aggregates, with one message
// published twice and one without a key, runs through the inbox: every
// keyed message's work runs once and in its aggregate's order, the second
// copy is a duplicate, the unkeyed one is dead-lettered under its stream
// position, and every message is acknowledged.
func TestExactlyOnce(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	evs := events("m", 300, 7)
	publish(t, js, evs...)
	publish(t, js, evs[42])                   // the relay published it again
	publish(t, js, event{aggregate: "agg-x"}) // no ce-id: sequence 302

	f := newFixture(t, srv)
	f.cfg.BatchSize = 50
	f.run(f.consumer(nil))
	f.waitDone(len(evs) + 1)
	f.waitAcked(js)

	f.exactlyOnce(evs)
	var state, ref string
	err := f.db.Pool.QueryRow(context.Background(),
		`SELECT state, msg_id FROM inbox_message WHERE msg_source = '!unkeyed'`).Scan(&state, &ref)
	if err != nil {
		t.Fatal(err)
	}
	if state != "DEAD" || ref != testStream+"/302" {
		t.Errorf("the unkeyed message is %s under %q, want DEAD under %q", state, ref, testStream+"/302")
	}
	if n := f.scalar(`SELECT count(*) FROM inbox_message WHERE order_key LIKE 'order/agg-%' AND origin = $1`, testSubject); n != len(evs) {
		t.Errorf("%d rows with order key order/<aggregate> and origin %s, want %d", n, testSubject, len(evs))
	}
	// One replica, no failures: each aggregate's messages ran in stream
	// order.
	if n := f.scalar(`
SELECT count(*) FROM (
  SELECT split_part(id, '-', 2)::int AS seq, lag(split_part(id, '-', 2)::int) OVER (PARTITION BY order_key ORDER BY n) AS prev
  FROM seen) s WHERE seq < prev`); n != 0 {
		t.Errorf("%d messages ran before an earlier one of their aggregate", n)
	}
}

// TestSettleAfterCommit: the message stays unacknowledged on the server
// while its work is running, past the consumer's ack wait (in-progress
// acks keep it from redelivery), and is acknowledged once the work
// committed.
func TestSettleAfterCommit(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	f := newFixture(t, srv)
	f.src.NATS.AckWait = time.Second

	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	handler := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		once.Do(func() { close(entered) })
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return inbox.SQLHandler{SQL: seenSQL}.Handle(ctx, tx, m)
	})
	f.run(f.consumer(handler))
	publish(t, js, event{id: "slow", aggregate: "a"})
	<-entered

	// Held for over twice the ack wait: a real span of time is the point.
	time.Sleep(2500 * time.Millisecond)
	info := f.consumerInfo(js)
	if info.NumAckPending != 1 || info.NumRedelivered != 0 || info.Delivered.Consumer != 1 {
		t.Errorf("while the work runs: ack pending %d, redelivered %d, delivered %d; want 1, 0, 1",
			info.NumAckPending, info.NumRedelivered, info.Delivered.Consumer)
	}
	if n := f.scalar(`SELECT count(*) FROM inbox_message WHERE state = 'PROCESSED'`); n != 0 {
		t.Errorf("%d messages processed before the work returned", n)
	}
	close(release)
	f.waitAcked(js)
	if n := f.scalar(`SELECT count(*) FROM inbox_message WHERE state = 'PROCESSED'`); n != 1 {
		t.Errorf("acknowledged with %d messages processed, want 1", n)
	}
	f.exactlyOnce([]event{{id: "slow"}})
}

// TestRedeliveryIsDuplicate: the work commits but the ack is lost (as if
// the replica died right after the commit); the server redelivers after
// its ack wait, and the redelivery is a duplicate whose work does not run
// again.
func TestRedeliveryIsDuplicate(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	f := newFixture(t, srv)
	f.src.NATS.AckWait = time.Second
	evs := events("r", 20, 3)
	publish(t, js, evs...)

	lose := &loseFirstSettle{Handoff: f.consumer(nil), outcomes: map[string][]inbox.Outcome{}}
	f.run(lose)
	f.waitAcked(js)
	f.exactlyOnce(evs)
	for _, e := range evs {
		if got := lose.of(e.id); len(got) != 2 || got[0] != inbox.Processed || got[1] != inbox.Duplicate {
			t.Errorf("message %s: outcomes %v, want [processed duplicate]", e.id, got)
		}
	}
}

// loseFirstSettle drops the first settle of every message: the outcome is
// recorded, the source never hears of it.
type loseFirstSettle struct {
	inbox.Handoff
	mu       sync.Mutex
	outcomes map[string][]inbox.Outcome
}

func (l *loseFirstSettle) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		settle, id := d.Settle, d.Message.ID
		d.Settle = func(ctx context.Context, o inbox.Outcome, after time.Duration) error {
			l.mu.Lock()
			l.outcomes[id] = append(l.outcomes[id], o)
			first := len(l.outcomes[id]) == 1
			l.mu.Unlock()
			if first {
				return nil
			}
			return settle(ctx, o, after)
		}
	}
	l.Handoff.Process(ctx, batch)
}

func (l *loseFirstSettle) of(id string) []inbox.Outcome {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.outcomes[id]
}

// TestBusyIsNakedWithDelay: a message another replica holds (its claim's
// lease still running) is nak'd with the inbox's delay, comes back once
// the lease has expired, and is then taken over and processed once,
// spending no attempt.
func TestBusyIsNakedWithDelay(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	f := newFixture(t, srv)
	claimedElsewhere(t, f, "held", 2*time.Second)
	publish(t, js, event{id: "held", aggregate: "a"})
	f.run(f.consumer(nil))
	f.waitAcked(js)
	f.exactlyOnce([]event{{id: "held"}})
	if n := f.scalar(`SELECT count(*) FROM inbox_message WHERE attempts > 0`); n != 0 {
		t.Errorf("%d messages spent an attempt", n)
	}
	if info := f.consumerInfo(js); info.Delivered.Consumer < 2 {
		t.Errorf("delivered %d times, want a redelivery after the nak", info.Delivered.Consumer)
	}
}

// claimedElsewhere inserts id's inbox row as another replica's claim whose
// lease ends after lease.
func claimedElsewhere(t *testing.T, f *fixture, id string, lease time.Duration) {
	t.Helper()
	_, err := f.db.Pool.Exec(context.Background(), `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, owner, lease_token, lease_until)
VALUES ($1, 'order', $2, 'RECEIVED', 'another-replica', 1, now() + $3::interval)`, f.src.Name, id, lease)
	if err != nil {
		t.Fatal(err)
	}
}

// TestOutage: the server stops while a backlog is being consumed. The
// source reports down, then up once the server is back; every message is
// processed exactly once, none spends an attempt.
func TestOutage(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	f := newFixture(t, srv)
	f.cfg.BatchSize = 10
	first := events("before", 200, 5)
	publish(t, srv.js(t), first...)
	f.run(f.consumer(nil))
	testkit.Eventually(t, 30*time.Second, "the first messages processed", func() bool {
		return f.scalar(`SELECT count(*) FROM seen`) > 0
	})

	srv.stop()
	testkit.Eventually(t, 30*time.Second, "the source reported down", func() bool { return f.states.String() == "[up down]" })
	srv.start(t)
	testkit.Eventually(t, 30*time.Second, "the source reported up again", func() bool { return f.states.String() == "[up down up]" })
	js := srv.js(t)
	second := events("after", 50, 5)
	publish(t, js, second...)

	all := append(first, second...)
	f.waitDone(len(all))
	f.waitAcked(js)
	f.exactlyOnce(all)
	if n := f.scalar(`SELECT count(*) FROM inbox_message WHERE attempts > 0 OR state <> 'PROCESSED'`); n != 0 {
		t.Errorf("%d messages spent an attempt or are not processed", n)
	}
}

// TestSetupErrors: what no retry can fix ends Run with sink.ErrSetup or
// sink.ErrRefused, naming the key to change and never the password.
func TestSetupErrors(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	f := newFixture(t, srv)
	secured := startServerWith(t, func(o *server.Options) { o.Username, o.Password = "inbox", "pw-right-4c2a" })
	for name, c := range map[string]struct {
		change func(*inbox.NATSSource)
		want   error
		key    string
	}{
		"missing stream":   {func(c *inbox.NATSSource) { c.Stream = "NOPE" }, sink.ErrSetup, "inbox.sources[orders].nats.stream"},
		"missing consumer": {func(c *inbox.NATSSource) { c.CreateConsumer, c.Consumer = false, "nope" }, sink.ErrSetup, "inbox.sources[orders].nats.consumer"},
		"missing CA file":  {func(c *inbox.NATSSource) { c.TLSCAFile = "/nonexistent/ca.pem" }, sink.ErrSetup, "inbox.sources[orders].nats.tls_ca_file"},
		"refused password": {func(c *inbox.NATSSource) { c.URL, c.User, c.Password = secured.url(), "inbox", "pw-secret-9d1e" }, sink.ErrRefused, ""},
	} {
		t.Run(name, func(t *testing.T) {
			src := f.src
			c.change(&src.NATS)
			s, err := New(src, f.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err = s.Run(ctx, f.consumer(nil))
			if !errors.Is(err, c.want) || !strings.Contains(fmt.Sprint(err), c.key) {
				t.Errorf("Run = %v; want %v naming %s", err, c.want, c.key)
			}
			if strings.Contains(fmt.Sprint(err), "pw-secret-9d1e") {
				t.Errorf("the password is in the error: %v", err)
			}
		})
	}
}

// TestNewRejectsBadSettings: New names the key of a bad setting.
func TestNewRejectsBadSettings(t *testing.T) {
	t.Parallel()
	base := inbox.DefaultSource()
	base.Name = "orders"
	base.NATS.Consumer = "inbox"
	for key, change := range map[string]func(*inbox.NATSSource){
		".url":             func(c *inbox.NATSSource) { c.URL = "" },
		".stream":          func(c *inbox.NATSSource) { c.Stream = "a.b" },
		".consumer":        func(c *inbox.NATSSource) { c.Consumer = "" },
		".ack_wait":        func(c *inbox.NATSSource) { c.CreateConsumer, c.AckWait = true, 0 },
		".max_ack_pending": func(c *inbox.NATSSource) { c.CreateConsumer, c.MaxAckPending = true, 0 },
		".password":        func(c *inbox.NATSSource) { c.Password = "x" },
		".tls_cert_file":   func(c *inbox.NATSSource) { c.TLSCertFile = "c.pem" },
		": user, token":    func(c *inbox.NATSSource) { c.User, c.Token = "u", "t" },
		".connect_timeout": func(c *inbox.NATSSource) { c.ConnectTimeout = 0 },
		".filter_subject":  func(c *inbox.NATSSource) { c.FilterSubject = "a b" },
	} {
		src := base
		change(&src.NATS)
		_, err := New(src, inbox.DefaultConfig(), nil)
		if want := "inbox.sources[orders].nats" + key; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New = %v, want an error naming %s", err, want)
		}
	}
}
