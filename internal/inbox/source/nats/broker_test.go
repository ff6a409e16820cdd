package nats

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Ordered mode (max_ack_pending 1) with the default batch_size: each
// fetch asks for what the consumer lets out, one message, and returns as
// soon as it has it, instead of waiting for 99 more that cannot come
// until it acks. 300 messages used to take 300s (a second each); the
// bound here is ten times looser than the rate measured on a quiet
// machine, and still 10 times tighter than that.
func TestOrderedModeDoesNotWaitOutAFetch(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	const n = 300
	evs := inboxtest.Events("o", n, 3)
	publish(t, js, evs...)
	f := newFixture(t, srv)
	f.Src.NATS.MaxAckPending = 1
	if f.Cfg.BatchSize != inboxconfig.DefaultConfig().BatchSize {
		t.Fatal("the fixture changed batch_size; this test is about the default")
	}
	began := time.Now()
	f.run(f.Consumer(nil))
	f.WaitDone(n)
	took := time.Since(began)
	t.Logf("%d messages one at a time in %s: %.0f messages/s", n, took.Round(time.Millisecond), n/took.Seconds())
	if took > 30*time.Second {
		t.Errorf("%d messages in ordered mode took %s, want well under 30s", n, took)
	}
	f.waitAcked(js)
	f.ExactlyOnce(evs)
	// One at a time: the stream's order, for every aggregate.
	if got := f.Scalar(`SELECT count(*) FROM (
		SELECT split_part(id, '-', 2)::int AS seq, lag(split_part(id, '-', 2)::int) OVER (ORDER BY n) AS prev FROM seen) s
		WHERE seq < prev`); got != 0 {
		t.Errorf("%d messages ran before one published earlier", got)
	}
}

// A replica that dies holding the consumer's only message out (ordered
// mode) stops the stream for ack_wait, not longer: the server redelivers
// it to the live replica, which takes it over.
func TestDeadReplicasMessageComesBackAfterAckWait(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	f := newFixture(t, srv)
	f.Src.NATS.MaxAckPending, f.Src.NATS.AckWait = 1, inboxconfig.DefaultSource().NATS.AckWait
	ackWait := f.Src.NATS.AckWait
	if ackWait > 5*time.Second {
		t.Fatalf("the default ack_wait is %s; a dead replica's messages would wait that long", ackWait)
	}
	// The consumer as the source creates it, then a "replica" that takes
	// the first message and dies without a word.
	stream, err := js.Stream(context.Background(), testStream)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.CreateOrUpdateConsumer(context.Background(), jetstream.ConsumerConfig{
		Durable: f.Src.NATS.Consumer, AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait, MaxAckPending: 1, MaxDeliver: -1,
	}); err != nil {
		t.Fatal(err)
	}
	evs := inboxtest.Events("k", 5, 1)
	publish(t, js, evs...)
	nc, err := nats.Connect(srv.url())
	if err != nil {
		t.Fatal(err)
	}
	djs, _ := jetstream.New(nc)
	dead, err := djs.Consumer(context.Background(), testStream, f.Src.NATS.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	got, err := collect(dead.Fetch(1, jetstream.FetchMaxWait(5*time.Second)))
	if err != nil || len(got) != 1 {
		t.Fatalf("the dying replica's fetch: %d messages, %v", len(got), err)
	}
	nc.Close()
	died := time.Now()

	f.run(f.Consumer(nil))
	f.WaitDone(len(evs))
	stall := time.Since(died)
	t.Logf("the stream stalled %s after the replica died (ack_wait %s)", stall.Round(time.Millisecond), ackWait)
	if stall > ackWait+3*time.Second {
		t.Errorf("the dead replica's message came back after %s, want about ack_wait (%s)", stall, ackWait)
	}
	f.waitAcked(js)
	f.ExactlyOnce(evs)
}

// A server that stops answering without closing its connections (frozen:
// SIGSTOP, a network that drops packets) is found within the ping bound:
// the source reports down once (inbox_source_up 0 and one log line), and
// up again when the server answers. Acks lost with the connection make
// at most one line, and their messages are duplicates the second time.
func TestFrozenServerIsDetected(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	px := startProxy(t, srv.srv.Addr().String())
	f := newFixture(t, srv)
	f.Src.NATS.URL = px.url()
	f.Cfg.BatchSize = 20
	first := inboxtest.Events("before", 200, 5)
	publish(t, js, first...)
	f.run(f.Consumer(nil))
	testkit.Eventually(t, 30*time.Second, "the first messages processed", func() bool {
		return f.Scalar(`SELECT count(*) FROM seen`) > 0
	})

	px.freeze()
	frozen := time.Now()
	bound := (maxPingsOut+1)*pingInterval + 2*time.Second
	testkit.Eventually(t, bound+5*time.Second, "the source reported down", func() bool { return f.States.String() == "[up down]" })
	found := time.Since(frozen)
	t.Logf("a frozen server found after %s (bound %s)", found.Round(time.Millisecond), bound)
	if found > bound {
		t.Errorf("a frozen server went unnoticed for %s, want at most %s", found, bound)
	}
	// Frozen on, for a few reconnect attempts: still one report. A real
	// span of time is the point.
	time.Sleep(3 * time.Second)
	if s := f.States.String(); s != "[up down]" {
		t.Errorf("while frozen: %s, want one down report", s)
	}
	px.thaw()
	testkit.Eventually(t, 30*time.Second, "the source reported up again", func() bool { return f.States.String() == "[up down up]" })

	second := inboxtest.Events("after", 50, 5)
	publish(t, js, second...)
	all := append(first, second...)
	f.WaitDone(len(all))
	f.waitAcked(js)
	f.ExactlyOnce(all)
	if n := len(f.logs.Lines(t, "nats acknowledgements lost with the connection; the server redelivers those messages after ack_wait, and the inbox answers them as duplicates without running their work again")); n > 1 {
		t.Errorf("%d lines about lost acks for one outage, want at most one", n)
	}
	for _, l := range f.logs.Lines(t, "") {
		if strings.Contains(l["msg"].(string), "could not settle") {
			t.Errorf("a line per lost ack: %v", l)
		}
	}
}

// Acks that cannot be sent are counted, not returned as errors: the
// inbox would log each.
func TestLostAcksAreCountedOnce(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	srv.createStream(t)
	js := srv.js(t)
	publish(t, js, inboxtest.Events("l", 3, 1)...)
	nc, err := nats.Connect(srv.url())
	if err != nil {
		t.Fatal(err)
	}
	cjs, _ := jetstream.New(nc)
	stream, err := cjs.Stream(context.Background(), testStream)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(context.Background(), jetstream.ConsumerConfig{Durable: "lost", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := collect(cons.Fetch(3, jetstream.FetchMaxWait(5*time.Second)))
	if err != nil || len(msgs) != 3 {
		t.Fatalf("fetch: %d, %v", len(msgs), err)
	}
	nc.Close()
	acks := &ackLog{}
	for _, m := range msgs {
		if err := settle(m, acks)(context.Background(), inbox.Processed, 0); err != nil {
			t.Errorf("settle on a closed connection: %v, want nil (counted)", err)
		}
	}
	if acks.lost != 3 || !errors.Is(acks.first, nats.ErrConnectionClosed) {
		t.Errorf("lost %d acks (%v), want 3 with the connection closed", acks.lost, acks.first)
	}
	logs := &testkit.LogBuffer{}
	s := &Source{log: logs.Logger()}
	s.reportLostAcks(acks)
	s.reportLostAcks(acks)
	if n := len(logs.Lines(t, "")); n != 1 {
		t.Errorf("%d lines for one session's lost acks, want 1", n)
	}
}
