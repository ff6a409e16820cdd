package nats

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// streamHolds reports whether the target's stream holds a message with
// the event id.
func (tg target) streamHolds(t *testing.T, eventID string) bool {
	t.Helper()
	for _, m := range tg.read(t) {
		if m.ID == eventID {
			return true
		}
	}
	return false
}

// TestUnavailable: what says the server, not the event, failed is
// Unavailable, and a publish that failed while the server was away never
// reaches the stream later on its own: the client buffers nothing for the
// reconnect.
func TestUnavailable(t *testing.T) {
	t.Parallel()

	t.Run("server down, then back on the same store", func(t *testing.T) {
		t.Parallel()
		tg, srv := newTargetInProcess(t)
		tg.createStream(t, 0)
		s := connect(t, tg.config())
		if err := s.Publish(t.Context(), sinktest.Event("up", 0)); err != nil {
			t.Fatal(err)
		}
		srv.stop()
		testkit.Eventually(t, 10*time.Second, "the sink to see the server gone", func() bool { return s.Ready(t.Context()) != nil })
		lost := sinktest.Event("down", 0)
		err := s.Publish(t.Context(), lost)
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Fatalf("publish while the server is down: got %v, want Unavailable", err)
		}
		if !errors.Is(err, nats.ErrReconnectBufExceeded) {
			t.Errorf("got %v, want the reconnect buffer refusing it (ReconnectBufSize -1)", err)
		}
		srv.start(t)
		testkit.Eventually(t, 20*time.Second, "the sink to reconnect", func() bool { return s.Ready(t.Context()) == nil })
		after := sinktest.Event("down", 1)
		testkit.Eventually(t, 20*time.Second, "a publish after the reconnect", func() bool {
			return s.Publish(t.Context(), after) == nil
		})
		if tg.streamHolds(t, lost.EventID) {
			t.Error("the event refused while the server was down reached the stream after the reconnect")
		}
	})

	t.Run("no ack within publish_timeout", func(t *testing.T) {
		t.Parallel()
		mute := muteTarget(t)
		cfg := mute.config()
		cfg.PublishTimeout = 100 * time.Millisecond
		s := connect(t, cfg)
		err := s.Publish(t.Context(), sinktest.Event("silent", 0))
		if !outbox.IsUnavailable(err) || !errors.Is(err, jetstream.ErrAsyncPublishTimeout) {
			t.Errorf("got %v, want Unavailable wrapping the ack timeout", err)
		}
	})

	t.Run("cancelled while waiting for the ack", func(t *testing.T) {
		t.Parallel()
		mute := muteTarget(t)
		cfg := mute.config()
		cfg.PublishTimeout = time.Hour
		s := connect(t, cfg)
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(50*time.Millisecond, cancel)
		if err := s.Publish(ctx, sinktest.Event("silent", 1)); !outbox.IsUnavailable(err) || !errors.Is(err, context.Canceled) {
			t.Errorf("got %v, want Unavailable wrapping context.Canceled", err)
		}
	})

	t.Run("no responders: no stream takes the subject", func(t *testing.T) {
		t.Parallel()
		tg, _ := newTargetInProcess(t)
		cfg := tg.config()
		cfg.CreateStream = true
		s := connect(t, cfg)
		if err := tg.js(t).DeleteStream(t.Context(), tg.stream); err != nil {
			t.Fatal(err)
		}
		err := s.Publish(t.Context(), sinktest.Event("nobody", 0))
		if !outbox.IsUnavailable(err) || !errors.Is(err, jetstream.ErrNoStreamResponse) {
			t.Errorf("got %v, want Unavailable wrapping no responders", err)
		}
	})

	t.Run("a full stream that discards new messages", func(t *testing.T) {
		t.Parallel()
		tg, _ := newTargetInProcess(t)
		if _, err := tg.js(t).CreateStream(t.Context(), jetstream.StreamConfig{Name: tg.stream, Subjects: []string{tg.prefix + ".>"},
			MaxMsgs: 1, Discard: jetstream.DiscardNew}); err != nil {
			t.Fatal(err)
		}
		s := connect(t, tg.config())
		if err := s.Publish(t.Context(), sinktest.Event("full", 0)); err != nil {
			t.Fatal(err)
		}
		err := s.Publish(t.Context(), sinktest.Event("full", 1))
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Errorf("got %v, want Unavailable", err)
		}
	})
}

// muteTarget is a target whose stream holds other subjects, with a plain
// subscriber that takes the sink's messages and never acknowledges them.
func muteTarget(t *testing.T) target {
	t.Helper()
	mute, _ := newTargetInProcess(t)
	if _, err := mute.js(t).CreateStream(t.Context(), jetstream.StreamConfig{Name: mute.stream, Subjects: []string{"elsewhere.>"}}); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(mute.url, nats.UserInfo(mute.user, mute.password))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if _, err := nc.Subscribe(mute.prefix+".>", func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return mute
}

// TestPermanent: what the server refuses about the message itself is
// permanent, and the connection stays usable for the next event.
func TestPermanent(t *testing.T) {
	t.Parallel()
	tg, _ := newTargetInProcess(t)
	tg.createStream(t, 64<<10)
	s := connect(t, tg.config())
	for name, e := range map[string]outbox.Event{
		"a header block over 64 KiB": func() outbox.Event {
			e := sinktest.Event("headers", 0)
			e.Headers["x-big"] = strings.Repeat("h", 100<<10)
			return e
		}(),
		"a message over the stream's max_msg_size": func() outbox.Event {
			e := sinktest.Event("size", 0)
			e.Payload = []byte(`"` + strings.Repeat("x", 70<<10) + `"`)
			return e
		}(),
		"a message over the server's max_payload": func() outbox.Event {
			e := sinktest.Event("payload", 0)
			e.Payload = []byte(`"` + strings.Repeat("x", 2<<20) + `"`)
			return e
		}(),
	} {
		err := s.Publish(t.Context(), e)
		if !outbox.IsPermanent(err) || outbox.IsUnavailable(err) {
			t.Errorf("%s: got %v, want a permanent error", name, err)
		}
	}
	if err := s.Publish(t.Context(), sinktest.Event("after", 0)); err != nil {
		t.Errorf("the next event: %v", err)
	}
}
