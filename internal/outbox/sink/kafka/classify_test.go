package kafka

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/testkit"
)

const classifyTopic = "Sales_20Order" // TopicPart("Sales Order")

// TestUnavailable: brokers that are away, short of in-sync replicas, or
// silent are Unavailable; a missing topic stays this event's failure.
func TestUnavailable(t *testing.T) {
	t.Parallel()

	t.Run("brokers down, then restarted on the same data", func(t *testing.T) {
		t.Parallel()
		cl := startCluster(t, classifyTopic)
		cfg := config(cl.brokers(), "{aggregate_type}")
		cfg.PublishTimeout = time.Second
		s := connect(t, cfg)
		if err := s.Publish(t.Context(), sinktest.Event("down", 0)); err != nil {
			t.Fatal(err)
		}
		cl.c.Close()
		err := s.Publish(t.Context(), sinktest.Event("down", 1))
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Fatalf("publish with every broker down: got %v, want Unavailable", err)
		}
		cl.start()
		testkit.Eventually(t, 30*time.Second, "a publish after the restart", func() bool {
			return s.Publish(t.Context(), sinktest.Event("down", 2)) == nil
		})
	})

	t.Run("not enough in-sync replicas", func(t *testing.T) {
		t.Parallel()
		cl := startCluster(t, classifyTopic)
		cfg := config(cl.brokers(), "{aggregate_type}")
		cfg.PublishTimeout = time.Second
		s := connect(t, cfg)
		cl.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.NotEnoughReplicas, Count: -1})
		err := s.Publish(t.Context(), sinktest.Event("isr", 0))
		if !outbox.IsUnavailable(err) || outbox.IsPermanent(err) {
			t.Errorf("got %v, want Unavailable", err)
		}
	})

	t.Run("a record on the wire without an answer", func(t *testing.T) {
		t.Parallel()
		cl := startCluster(t, classifyTopic)
		var silent atomic.Bool
		silent.Store(true)
		cl.c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
			cl.c.KeepControl()
			return nil, nil, silent.Load() // swallowed while silent, else served
		})
		cfg := config(cl.brokers(), "{aggregate_type}")
		cfg.PublishTimeout = time.Second
		s := connect(t, cfg)
		first := s.current()
		lost := sinktest.Event("wire", 0)
		err := s.Publish(t.Context(), lost)
		if !outbox.IsUnavailable(err) || !strings.Contains(err.Error(), "outcome is unknown") {
			t.Fatalf("got %v, want Unavailable with the outcome unknown", err)
		}
		if s.current() == first {
			t.Error("the client that held the record on the wire is still in use: it would resend the record")
		}
		silent.Store(false)
		next := sinktest.Event("wire", 1)
		if err := s.Publish(t.Context(), next); err != nil {
			t.Fatalf("the next publish, through the new client: %v", err)
		}
		for _, m := range read(t, cl.brokers(), classifyTopic) {
			if m.ID == lost.EventID {
				t.Error("the record given up on reached the topic")
			}
		}
	})
}

// TestPermanent: what the broker refuses about the record itself is
// permanent, and the client stays usable for the next event.
func TestPermanent(t *testing.T) {
	t.Parallel()
	cl := startCluster(t, classifyTopic)
	s := connect(t, config(cl.brokers(), "{aggregate_type}"))
	big := sinktest.Event("big", 0)
	big.Payload = []byte(`"` + strings.Repeat("x", 1_100_000) + `"`)
	if err := s.Publish(t.Context(), big); !outbox.IsPermanent(err) || !errors.Is(err, kerr.MessageTooLarge) {
		t.Errorf("an oversize record: got %v, want permanent MESSAGE_TOO_LARGE", err)
	}
	cl.c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.InvalidRecord})
	if err := s.Publish(t.Context(), sinktest.Event("invalid", 0)); !outbox.IsPermanent(err) {
		t.Errorf("a record the broker's validation refuses: got %v, want permanent", err)
	}
	if err := s.Publish(t.Context(), sinktest.Event("after", 0)); err != nil {
		t.Errorf("the next event: %v", err)
	}
}

// classify sorts the client's own verdicts too.
func TestClassifyClientErrors(t *testing.T) {
	t.Parallel()
	for _, err := range []error{kgo.ErrRecordTimeout, kgo.ErrRecordRetries, kgo.ErrClientClosed, kerr.RequestTimedOut, kerr.NotEnoughReplicasAfterAppend, kerr.LeaderNotAvailable} {
		if got := classify(err); !outbox.IsUnavailable(got) {
			t.Errorf("%v: not Unavailable", err)
		}
	}
	if got := classify(errors.Join(kgo.ErrRecordTimeout, kerr.UnknownTopicOrPartition)); outbox.IsUnavailable(got) || outbox.IsPermanent(got) {
		t.Errorf("a record timed out on a missing topic: %v, want the event's failure", got)
	}
}
