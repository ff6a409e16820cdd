package kafka

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestExactlyOnce: records over several aggregates and partitions, with
// one produced twice and one without a key, run through the inbox: every
// keyed record's work runs once and in its aggregate's order, the second
// copy is a duplicate, the unkeyed one is dead-lettered under its topic,
// partition and offset, and the group commits through the end.
func TestExactlyOnce(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	c := cl.client(t)
	evs := inboxtest.Events("m", 300, 7)
	produce(t, c, evs...)
	produce(t, c, evs[42]) // the relay published it again
	unkeyed := produce(t, c, event{Aggregate: "agg-x"})[0]

	f := newFixture(t, cl)
	f.Cfg.BatchSize = 50
	rec := inboxtest.RecordOutcomes(f.Consumer(nil))
	f.run(rec)
	f.WaitDone(len(evs) + 1)
	f.waitCommitted(c)

	f.ExactlyOnce(evs)
	if n := rec.Count(inbox.Duplicate); n != 1 {
		t.Errorf("%d duplicates, want 1", n)
	}
	var state, ref string
	err := f.DB.Pool.QueryRow(context.Background(),
		`SELECT state, msg_id FROM inbox_message WHERE msg_source = '!unkeyed'`).Scan(&state, &ref)
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("%s/%d/%d", testTopic, unkeyed.Partition, unkeyed.Offset); state != "DEAD" || ref != want {
		t.Errorf("the unkeyed record is %s under %q, want DEAD under %q", state, ref, want)
	}
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE order_key LIKE 'order/agg-%' AND origin = $1`, testTopic); n != len(evs) {
		t.Errorf("%d rows with order key order/<aggregate> and origin %s, want %d", n, testTopic, len(evs))
	}
	if n := f.Scalar(`
SELECT count(*) FROM (
  SELECT split_part(id, '-', 2)::int AS seq, lag(split_part(id, '-', 2)::int) OVER (PARTITION BY order_key ORDER BY n) AS prev
  FROM seen) s WHERE seq < prev`); n != 0 {
		t.Errorf("%d records ran before an earlier one of their aggregate", n)
	}
}

// TestSettleAfterCommit: the group's offset stays before a record while
// its work runs, and passes it once the work committed.
func TestSettleAfterCommit(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	c := cl.client(t)
	f := newFixture(t, cl)
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
	r := produce(t, c, event{ID: "slow", Aggregate: "a"})[0]
	<-entered
	if at, ok := f.committed(c)[r.Partition]; ok && at > r.Offset {
		t.Errorf("offset %d committed while the work of offset %d runs", at, r.Offset)
	}
	close(release)
	f.waitCommitted(c)
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE state = 'PROCESSED'`); n != 1 {
		t.Errorf("committed with %d messages processed, want 1", n)
	}
}

// TestCommitsAfterProcessing: a consumer stopped between two batches of
// a backlog (the next one polled, not yet worked on), and a new client in
// the same group after it: every record is processed once; the new client
// meets no record the first one processed (their offsets were committed
// with their work) and skips none (the polled batch was not committed).
func TestCommitsAfterProcessing(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	c := cl.client(t)
	f := newFixture(t, cl)
	f.Cfg.BatchSize = 10
	first := inboxtest.Events("first", 300, 7)
	produce(t, c, first...)
	gate := &stopAfter{Handoff: f.Consumer(nil), batches: 5, held: make(chan struct{})}
	stop := f.run(gate)
	<-gate.held
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	processed := f.Scalar(`SELECT count(*) FROM seen`)
	if processed == 0 || processed >= len(first) {
		t.Fatalf("the first client processed %d records, want some of %d", processed, len(first))
	}

	second := inboxtest.Events("second", 50, 7)
	produce(t, c, second...)
	rec := inboxtest.RecordOutcomes(f.Consumer(nil))
	f.run(rec)
	all := append(first, second...)
	f.WaitDone(len(all))
	f.waitCommitted(c)
	f.ExactlyOnce(all)
	if n := rec.Count(inbox.Duplicate); n != 0 {
		t.Errorf("the second client met %d records the first had processed", n)
	}
	if n := rec.Count(inbox.Processed); n != len(all)-processed {
		t.Errorf("the second client processed %d records, want %d (the first processed %d)", n, len(all)-processed, processed)
	}
}

// stopAfter passes batches on until it has passed the given number; it
// holds the next one, unsettled, until ctx ends.
type stopAfter struct {
	inbox.Handoff
	batches int
	held    chan struct{}
}

func (s *stopAfter) Process(ctx context.Context, batch []*inbox.Delivery) {
	if s.batches > 0 {
		s.batches--
		s.Handoff.Process(ctx, batch)
		return
	}
	close(s.held)
	<-ctx.Done()
}

// TestBusyRetriedInPlace: a record another replica holds is handed to the
// inbox again after the wait it asks for, while the partition's offset
// stays before it; once the claim's lease has expired it is taken over,
// processed once, spending no attempt, and committed past.
func TestBusyRetriedInPlace(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	c := cl.client(t)
	f := newFixture(t, cl)
	f.ClaimedElsewhere("held", 2*time.Second)
	// One aggregate, so one partition: the held record, then two more.
	recs := produce(t, c, event{ID: "held", Aggregate: "a"}, event{ID: "next-1", Aggregate: "a"}, event{ID: "next-2", Aggregate: "a"})
	held := recs[0]
	f.run(f.Consumer(nil))
	testkit.Eventually(t, 30*time.Second, "the held record processed", func() bool {
		// The offsets first: read after, a commit that follows the
		// processing would look like one that came before it.
		at, ok := f.committed(c)[held.Partition]
		done := f.Scalar(`SELECT count(*) FROM seen WHERE id = 'held'`) > 0
		if !done && ok && at > held.Offset {
			t.Fatalf("offset %d committed past the held record (offset %d) before it was processed", at, held.Offset)
		}
		return done
	})
	f.WaitDone(3)
	f.waitCommitted(c)
	f.ExactlyOnce([]event{{ID: "held"}, {ID: "next-1"}, {ID: "next-2"}})
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE attempts > 0`); n != 0 {
		t.Errorf("%d messages spent an attempt", n)
	}
}

// TestOutage: the cluster stops while a backlog is being consumed. The
// source reports down, then up once the cluster is back; every record is
// processed exactly once, none spends an attempt.
func TestOutage(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	f := newFixture(t, cl)
	f.Cfg.BatchSize = 10
	first := inboxtest.Events("before", 200, 5)
	produce(t, cl.client(t), first...)
	f.run(f.Consumer(nil))
	testkit.Eventually(t, 30*time.Second, "the first records processed", func() bool {
		return f.Scalar(`SELECT count(*) FROM seen`) > 0
	})

	cl.stop()
	testkit.Eventually(t, 60*time.Second, "the source reported down", func() bool { return f.States.String() == "[up down]" })
	cl.start()
	testkit.Eventually(t, 60*time.Second, "the source reported up again", func() bool { return f.States.String() == "[up down up]" })
	c := cl.client(t)
	second := inboxtest.Events("after", 50, 5)
	produce(t, c, second...)

	all := append(first, second...)
	f.WaitDone(len(all))
	f.waitCommitted(c)
	f.ExactlyOnce(all)
	if n := f.Scalar(`SELECT count(*) FROM inbox_message WHERE attempts > 0 OR state <> 'PROCESSED'`); n != 0 {
		t.Errorf("%d messages spent an attempt or are not processed", n)
	}
}

// TestSetupErrors: what no retry can fix ends Run with broker.ErrSetup or
// broker.ErrRefused, naming the key to change and never the password.
func TestSetupErrors(t *testing.T) {
	t.Parallel()
	const password = "pw-secret-5e0b"
	cl := startCluster(t)
	f := newFixture(t, cl)
	secured := startCluster(t, kfake.EnableSASL(), kfake.Superuser("PLAIN", "inbox", "pw-right-77aa"))
	refuseAsKafka(secured.c)
	for name, c := range map[string]struct {
		change func(*inboxconfig.KafkaSource)
		want   error
		key    string
	}{
		"missing topic":   {func(c *inboxconfig.KafkaSource) { c.Topics = testTopic + ",nope" }, broker.ErrSetup, "inbox.sources[orders].kafka.topics"},
		"missing CA file": {func(c *inboxconfig.KafkaSource) { c.TLSCAFile = "/nonexistent/ca.pem" }, broker.ErrSetup, "inbox.sources[orders].kafka.tls_ca_file"},
		// kfake, like Kafka, refuses sessions under 6s.
		"session timeout under the brokers' minimum": {func(c *inboxconfig.KafkaSource) { c.SessionTimeout = 2 * time.Second }, broker.ErrSetup, "inbox.sources[orders].kafka.session_timeout"},
		"refused password": {func(c *inboxconfig.KafkaSource) {
			c.Brokers, c.SASLMechanism, c.SASLUser, c.SASLPassword = secured.brokers(), "PLAIN", "inbox", password
		}, broker.ErrRefused, ""},
	} {
		t.Run(name, func(t *testing.T) {
			src := f.Src
			c.change(&src.Kafka)
			s, err := New(src, f.Cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			inboxtest.CheckSetupError(t, s, f.Consumer(nil), c.want, c.key, password)
		})
	}
}

// TestNewRejectsBadSettings: New names the key of a bad setting.
func TestNewRejectsBadSettings(t *testing.T) {
	t.Parallel()
	base := inboxconfig.DefaultSource()
	base.Name = "orders"
	base.Kafka.Topics, base.Kafka.Group = "t", "g"
	for key, change := range map[string]func(*inboxconfig.KafkaSource){
		".brokers":         func(c *inboxconfig.KafkaSource) { c.Brokers = " " },
		".topics":          func(c *inboxconfig.KafkaSource) { c.Topics = " , " },
		".group":           func(c *inboxconfig.KafkaSource) { c.Group = "" },
		".connect_timeout": func(c *inboxconfig.KafkaSource) { c.ConnectTimeout = 0 },
		".session_timeout": func(c *inboxconfig.KafkaSource) { c.SessionTimeout = 500 * time.Millisecond },
		".sasl_mechanism":  func(c *inboxconfig.KafkaSource) { c.SASLMechanism = "GSSAPI" },
		".sasl_user":       func(c *inboxconfig.KafkaSource) { c.SASLMechanism = "PLAIN" },
		".tls_cert_file":   func(c *inboxconfig.KafkaSource) { c.TLSKeyFile = "k.pem" },
	} {
		src := base
		change(&src.Kafka)
		_, err := New(src, inboxconfig.DefaultConfig(), nil)
		if want := "inbox.sources[orders].kafka" + key; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("New = %v, want an error naming %s", err, want)
		}
	}
}

// refuseAsKafka makes c answer a PLAIN SaslAuthenticate as a Kafka broker
// answers a wrong password (kfake itself closes the connection, which
// reads as an outage).
func refuseAsKafka(c *kfake.Cluster) {
	c.ControlKey(int16(kmsg.SASLAuthenticate), func(r kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		resp := r.(*kmsg.SASLAuthenticateRequest).ResponseKind().(*kmsg.SASLAuthenticateResponse)
		resp.ErrorCode = kerr.SaslAuthenticationFailed.Code
		resp.ErrorMessage = kmsg.StringPtr("Authentication failed during authentication due to invalid credentials with SASL mechanism PLAIN")
		return resp, nil, true
	})
}

// TestRebalanceTimeoutFollowsTheLease: the group waits for members to
// rejoin as long as a live one may take to settle its batch (the inbox's
// lease), not franz-go's 60 s, which a dead member's partitions would
// otherwise wait out when it dies during a rebalance.
func TestRebalanceTimeoutFollowsTheLease(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		lease, session, want time.Duration
	}{
		{lease: 9 * time.Second, session: 6 * time.Second, want: 9 * time.Second},
		{lease: 2 * time.Second, session: 6 * time.Second, want: 6 * time.Second},
	} {
		joined := make(chan int32, 1)
		cl := startCluster(t)
		cl.c.ControlKey(int16(kmsg.JoinGroup), func(req kmsg.Request) (kmsg.Response, error, bool) {
			cl.c.KeepControl()
			select {
			case joined <- req.(*kmsg.JoinGroupRequest).RebalanceTimeoutMillis:
			default:
			}
			return nil, nil, false // the cluster answers as usual
		})
		f := newFixture(t, cl)
		f.Cfg.LeaseTTL, f.Src.Kafka.SessionTimeout = c.lease, c.session
		f.run(f.Consumer(nil))
		select {
		case got := <-joined:
			if time.Duration(got)*time.Millisecond != c.want {
				t.Errorf("lease %s, session %s: the group's rebalance timeout is %dms, want %s", c.lease, c.session, got, c.want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("lease %s, session %s: the source never joined its group", c.lease, c.session)
		}
	}
}
