package nats

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
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
	evs := inboxtest.Events("m", 300, 7)
	publish(t, js, evs...)
	publish(t, js, evs[42])                   // the relay published it again
	publish(t, js, event{Aggregate: "agg-x"}) // no ce-id: sequence 302

	f := newFixture(t, srv)
	f.Cfg.BatchSize = 50
	f.run(f.Consumer(nil))
	f.WaitDone(len(evs) + 1)
	f.waitAcked(js)

	f.ExactlyOnce(evs)
	var state, ref string
	err := f.DB.Pool.QueryRow(context.Background(),
		`SELECT state, msg_id FROM inbox_message WHERE msg_source = '!unkeyed'`).Scan(&state, &ref)
	if err != nil {
		t.Fatal(err)
	}
	if state != "DEAD" || ref != testStream+"/302" {
		t.Errorf("the unkeyed message is %s under %q, want DEAD under %q", state, ref, testStream+"/302")
	}
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE order_key LIKE 'order/agg-%' AND origin = $1`, testSubject); n != len(evs) {
		t.Errorf("%d rows with order key order/<aggregate> and origin %s, want %d", n, testSubject, len(evs))
	}
	// One replica, no failures: each aggregate's messages ran in stream
	// order.
	if n := f.Scalar(`
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
	f.Src.NATS.AckWait = time.Second

	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	handler := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		once.Do(func() { close(entered) })
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return inbox.SQLHandler{SQL: inboxtest.SeenSQL}.Handle(ctx, tx, m)
	})
	f.run(f.Consumer(handler))
	publish(t, js, event{ID: "slow", Aggregate: "a"})
	<-entered

	// Held for over twice the ack wait: a real span of time is the point.
	time.Sleep(2500 * time.Millisecond)
	info := f.consumerInfo(js)
	if info.NumAckPending != 1 || info.NumRedelivered != 0 || info.Delivered.Consumer != 1 {
		t.Errorf("while the work runs: ack pending %d, redelivered %d, delivered %d; want 1, 0, 1",
			info.NumAckPending, info.NumRedelivered, info.Delivered.Consumer)
	}
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE state = 'PROCESSED'`); n != 0 {
		t.Errorf("%d messages processed before the work returned", n)
	}
	close(release)
	f.waitAcked(js)
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE state = 'PROCESSED'`); n != 1 {
		t.Errorf("acknowledged with %d messages processed, want 1", n)
	}
	f.ExactlyOnce([]event{{ID: "slow"}})
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
	f.Src.NATS.AckWait = time.Second
	evs := inboxtest.Events("r", 20, 3)
	publish(t, js, evs...)

	lose := inboxtest.RecordOutcomes(f.Consumer(nil))
	lose.LoseFirst = true
	f.run(lose)
	f.waitAcked(js)
	f.ExactlyOnce(evs)
	for _, e := range evs {
		if got := lose.Of(e.ID); len(got) != 2 || got[0] != inbox.Processed || got[1] != inbox.Duplicate {
			t.Errorf("message %s: outcomes %v, want [processed duplicate]", e.ID, got)
		}
	}
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
	f.ClaimedElsewhere("held", 2*time.Second)
	publish(t, js, event{ID: "held", Aggregate: "a"})
	f.run(f.Consumer(nil))
	f.waitAcked(js)
	f.ExactlyOnce([]event{{ID: "held"}})
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE attempts > 0`); n != 0 {
		t.Errorf("%d messages spent an attempt", n)
	}
	if info := f.consumerInfo(js); info.Delivered.Consumer < 2 {
		t.Errorf("delivered %d times, want a redelivery after the nak", info.Delivered.Consumer)
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
	f.Cfg.BatchSize = 10
	first := inboxtest.Events("before", 200, 5)
	publish(t, srv.js(t), first...)
	f.run(f.Consumer(nil))
	testkit.Eventually(t, 30*time.Second, "the first messages processed", func() bool {
		return f.Scalar(`SELECT count(*) FROM seen`) > 0
	})

	srv.stop()
	testkit.Eventually(t, 30*time.Second, "the source reported down", func() bool { return f.States.String() == "[up down]" })
	srv.start(t)
	testkit.Eventually(t, 30*time.Second, "the source reported up again", func() bool { return f.States.String() == "[up down up]" })
	js := srv.js(t)
	second := inboxtest.Events("after", 50, 5)
	publish(t, js, second...)

	all := append(first, second...)
	f.WaitDone(len(all))
	f.waitAcked(js)
	f.ExactlyOnce(all)
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE attempts > 0 OR state <> 'PROCESSED'`); n != 0 {
		t.Errorf("%d messages spent an attempt or are not processed", n)
	}
}

// TestSetupErrors: what no retry can fix ends Run with broker.ErrSetup or
// broker.ErrRefused, naming the key to change and never the password.
func TestSetupErrors(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	f := newFixture(t, srv)
	secured := startServerWith(t, func(o *server.Options) { o.Username, o.Password = "inbox", "pw-right-4c2a" })
	for name, c := range map[string]struct {
		change func(*inboxconfig.NATSSource)
		want   error
		key    string
	}{
		"missing stream":   {func(c *inboxconfig.NATSSource) { c.Stream = "NOPE" }, broker.ErrSetup, "inbox.sources[orders].nats.stream"},
		"missing consumer": {func(c *inboxconfig.NATSSource) { c.CreateConsumer, c.Consumer = false, "nope" }, broker.ErrSetup, "inbox.sources[orders].nats.consumer"},
		"missing CA file":  {func(c *inboxconfig.NATSSource) { c.TLSCAFile = "/nonexistent/ca.pem" }, broker.ErrSetup, "inbox.sources[orders].nats.tls_ca_file"},
		"refused password": {func(c *inboxconfig.NATSSource) { c.URL, c.User, c.Password = secured.url(), "inbox", "pw-secret-9d1e" }, broker.ErrRefused, ""},
	} {
		t.Run(name, func(t *testing.T) {
			src := f.Src
			c.change(&src.NATS)
			s, err := New(src, f.Cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			inboxtest.CheckSetupError(t, s, f.Consumer(nil), c.want, c.key, "pw-secret-9d1e")
		})
	}
}

// TestNewRejectsBadSettings: New names the key of a bad setting.
func TestNewRejectsBadSettings(t *testing.T) {
	t.Parallel()
	base := inboxconfig.DefaultSource()
	base.Name = "orders"
	base.NATS.Consumer = "inbox"
	for key, change := range map[string]func(*inboxconfig.NATSSource){
		".url":             func(c *inboxconfig.NATSSource) { c.URL = "" },
		".stream":          func(c *inboxconfig.NATSSource) { c.Stream = "a.b" },
		".consumer":        func(c *inboxconfig.NATSSource) { c.Consumer = "" },
		".ack_wait":        func(c *inboxconfig.NATSSource) { c.CreateConsumer, c.AckWait = true, 0 },
		".max_ack_pending": func(c *inboxconfig.NATSSource) { c.CreateConsumer, c.MaxAckPending = true, 0 },
		".password":        func(c *inboxconfig.NATSSource) { c.Password = "x" },
		".tls_cert_file":   func(c *inboxconfig.NATSSource) { c.TLSCertFile = "c.pem" },
		": user, token":    func(c *inboxconfig.NATSSource) { c.User, c.Token = "u", "t" },
		".connect_timeout": func(c *inboxconfig.NATSSource) { c.ConnectTimeout = 0 },
		".filter_subject":  func(c *inboxconfig.NATSSource) { c.FilterSubject = "a b" },
	} {
		src := base
		change(&src.NATS)
		_, err := New(src, inboxconfig.DefaultConfig(), nil)
		if want := "inbox.sources[orders].nats" + key; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New = %v, want an error naming %s", err, want)
		}
	}
}
