package rabbitmq

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

// viaProxy connects a sink to tg through a proxy the test can cut.
func viaProxy(t *testing.T, tg target, publishTimeout time.Duration) (*Sink, *sinktest.Proxy) {
	t.Helper()
	u := testkit.ParseRabbitMQURL(t)
	p := sinktest.NewProxy(t, u.Host)
	u.Host = p.Addr()
	cfg := tg.config()
	cfg.URL = u.String()
	cfg.PublishTimeout = publishTimeout
	return connect(t, cfg), p
}

// TestUnavailable: a broker out of reach or not confirming is Unavailable,
// and the sink's reconnect sends the next event once, never the ones that
// failed before it.
func TestUnavailable(t *testing.T) {
	t.Parallel()
	tg := newTarget(t, "#")

	t.Run("connection cut, then back", func(t *testing.T) {
		t.Parallel()
		s, p := viaProxy(t, tg, 2*time.Second)
		if err := s.Publish(t.Context(), sinktest.Event("cut", 0)); err != nil {
			t.Fatal(err)
		}
		p.Cut()
		lost := sinktest.Event("cut", 1)
		err := s.Publish(t.Context(), lost)
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Fatalf("publish with the connection cut: got %v, want Unavailable", err)
		}
		p.Restore(t)
		next := sinktest.Event("cut", 2)
		testkit.Eventually(t, 20*time.Second, "a publish after the broker is back", func() bool {
			return s.Publish(t.Context(), next) == nil
		})
		held := map[string]int{}
		for _, m := range tg.read(t) {
			held[m.ID]++
		}
		if held[lost.EventID] != 0 {
			t.Error("the event that failed while the connection was cut reached the queue")
		}
		if held[next.EventID] < 1 {
			t.Error("the event published after the reconnect is not on the queue")
		}
	})

	t.Run("no confirm within publish_timeout", func(t *testing.T) {
		t.Parallel()
		s, p := viaProxy(t, tg, 200*time.Millisecond)
		p.Freeze()
		err := s.Publish(t.Context(), sinktest.Event("frozen", 0))
		if !outbox.IsUnavailable(err) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("got %v, want Unavailable wrapping the deadline", err)
		}
	})

	t.Run("cancelled while waiting for the confirm", func(t *testing.T) {
		t.Parallel()
		s, p := viaProxy(t, tg, time.Hour)
		p.Freeze()
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(50*time.Millisecond, cancel)
		if err := s.Publish(ctx, sinktest.Event("frozen", 1)); !outbox.IsUnavailable(err) || !errors.Is(err, context.Canceled) {
			t.Errorf("got %v, want Unavailable wrapping context.Canceled", err)
		}
	})

	t.Run("the broker closes the connection", func(t *testing.T) {
		t.Parallel()
		s := connect(t, tg.config())
		if err := s.Publish(t.Context(), sinktest.Event("closed", 0)); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		conn := s.conn
		s.mu.Unlock()
		_ = conn.Close()
		l := &link{closes: make(chan *amqp.Error, 1)}
		l.closes <- &amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - broker forced connection closure", Server: true}
		err := s.notConfirmed(sinktest.Event("closed", 1), l)
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Errorf("a confirm lost with the connection: got %v, want Unavailable", err)
		}
		if err := s.Publish(t.Context(), sinktest.Event("closed", 2)); err != nil {
			t.Errorf("the next publish reconnects: %v", err)
		}
	})
}

// TestPermanent: what the broker refuses about the event itself is
// permanent, and the connection stays usable for the next event.
func TestPermanent(t *testing.T) {
	t.Parallel()
	tg := newTarget(t, "Sales%20Order.*")
	s := connect(t, tg.config())

	t.Run("unroutable", func(t *testing.T) {
		e := sinktest.Event("nobody", 0)
		e.AggregateType = "Unbound"
		if err := s.Publish(t.Context(), e); !outbox.IsPermanent(err) {
			t.Errorf("got %v, want permanent", err)
		}
	})
	t.Run("headers over frame_max", func(t *testing.T) {
		e := sinktest.Event("big-headers", 0)
		e.Headers["x-big"] = strings.Repeat("h", 200<<10)
		if err := s.Publish(t.Context(), e); !outbox.IsPermanent(err) || outbox.IsUnavailable(err) {
			t.Errorf("got %v, want permanent", err)
		}
	})
	t.Run("a message over max_message_size", func(t *testing.T) {
		// The broker closes the channel naming the size; every publish in
		// flight on it fails, and only the event of that size is at fault.
		refusal := &amqp.Error{Code: amqp.PreconditionFailed, Server: true,
			Reason: "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000"}
		big, other := sinktest.Event("big", 0), sinktest.Event("other", 0)
		big.Payload = []byte(`"` + strings.Repeat("x", 1998) + `"`)
		l := &link{closes: make(chan *amqp.Error, 1)}
		l.closes <- refusal
		if err := s.notConfirmed(big, l); !outbox.IsPermanent(err) {
			t.Errorf("the event of that size: got %v, want permanent", err)
		}
		if err := s.notConfirmed(other, l); !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Errorf("another event in flight: got %v, want Unavailable", err)
		}
		// The limit is now known: a larger event is refused before it is sent.
		if err := s.Publish(t.Context(), big); !outbox.IsPermanent(err) || !strings.Contains(err.Error(), "max_message_size 1000") {
			t.Errorf("the next oversize event: got %v, want permanent at once", err)
		}
		s.maxMessage.Store(0)
	})
	if err := s.Publish(t.Context(), sinktest.Event("after", 0)); err != nil {
		t.Errorf("the next event: %v", err)
	}
}
