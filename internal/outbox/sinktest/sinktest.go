// Package sinktest checks that a broker sink keeps the outbox's Sink
// contract: Exercise runs the conformance suite against one sink, and
// RelayRun drives real relays in two processes through it.
package sinktest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/worker-dev/worker/internal/outbox"
)

// Message is one message read back from the broker.
type Message struct {
	ID      string            // the broker's message id (Nats-Msg-Id, message_id, ...)
	Attrs   map[string]string // CloudEvents attributes, decoded, without prefix; datacontenttype included
	Headers map[string]string // the other headers or properties
	Body    []byte
}

// Broker is a sink under test and the broker behind it. Each test gets its
// own stream, queue or topic, so Read sees only its messages.
type Broker struct {
	// New returns a connected sink. The suite closes it when it has Close.
	New func(t *testing.T) outbox.Sink
	// Read returns every message the broker holds for this test, in the
	// broker's order (per aggregate at least).
	Read func(t *testing.T) []Message
	// Refused returns an event the broker can never take, such as one
	// larger than it accepts.
	Refused func(t *testing.T) outbox.Event
	// Unreachable returns a sink that connected, and whose broker then went
	// away, with the given publish timeout.
	Unreachable func(t *testing.T, publishTimeout time.Duration) outbox.Sink
	// Silent returns a sink whose broker takes messages and never confirms
	// them, with the given publish timeout.
	Silent func(t *testing.T, publishTimeout time.Duration) outbox.Sink
	// Secret is a credential the sinks above were configured with: no error
	// may quote it.
	Secret string
	// ClassifiesUnavailable says the sink reports a broker that is down or
	// silent as unavailable (outbox.IsUnavailable), so the relay holds
	// events instead of spending their attempts. The suite then requires
	// it; without it, only that such failures are not permanent.
	ClassifiesUnavailable bool
}

// Event returns a test event of aggregate agg, number n of it.
func Event(agg string, n int) outbox.Event {
	payload, _ := json.Marshal(map[string]any{"aggregate": agg, "n": n, "text": "naïve \"quoted\" \n line"})
	return outbox.Event{
		EventID:       uuid.NewString(),
		AggregateType: "Sales Order", // a space: the sink must escape it where names are built from it
		AggregateID:   agg,
		EventType:     "order.updated",
		Payload:       payload,
		Headers:       map[string]string{"traceparent": fmt.Sprintf("00-%032x-%016x-01", n+1, n+1)},
		OccurredAt:    time.Date(2026, 1, 2, 3, 4, 5, 600_000_000, time.UTC).Add(time.Duration(n) * time.Second),
	}
}

// Exercise runs the conformance suite: nil only after the broker holds the
// event, its message id and CloudEvents attributes, per-aggregate order
// under concurrent Publish, permanent failures, an unreachable or silent
// broker reported as unavailable, cancellation through ctx,
// RetryAfterError, and no secret in any error.
func Exercise(t *testing.T, b Broker) {
	var (
		mu   sync.Mutex
		errs []error
	)
	seen := func(err error) error {
		if err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		return err
	}

	t.Run("nil means the broker holds it", func(t *testing.T) {
		s := b.New(t)
		if s.Name() == "" {
			t.Error("Name is empty")
		}
		const aggregates, perAggregate = 8, 25
		sent := make(map[string]outbox.Event)
		var wg sync.WaitGroup
		var smu sync.Mutex
		// Like the relay: aggregates concurrently, one aggregate in order,
		// each event only after the previous one returned nil.
		for a := range aggregates {
			agg := fmt.Sprintf("agg/%d.x*>", a) // characters that must not change a name's meaning
			wg.Go(func() {
				for n := range perAggregate {
					e := Event(agg, n)
					if err := seen(s.Publish(t.Context(), e)); err != nil {
						t.Errorf("publish %s #%d: %v", agg, n, err)
						return
					}
					smu.Lock()
					sent[e.EventID] = e
					smu.Unlock()
				}
			})
		}
		wg.Wait()
		msgs := b.Read(t)
		if len(msgs) != len(sent) {
			t.Errorf("broker holds %d messages, %d were published", len(msgs), len(sent))
		}
		last := map[string]int{}
		for _, m := range msgs {
			e, ok := sent[m.ID]
			if !ok {
				t.Errorf("message id %q is no published event_id", m.ID)
				continue
			}
			CheckMessage(t, m, e)
			var p struct{ N int }
			_ = json.Unmarshal(m.Body, &p)
			if prev, ok := last[e.AggregateID]; ok && p.N <= prev {
				t.Errorf("aggregate %s: #%d after #%d", e.AggregateID, p.N, prev)
			}
			last[e.AggregateID] = p.N
		}
		closeSink(t, s)
	})

	t.Run("a message the broker can never take is permanent", func(t *testing.T) {
		s := b.New(t)
		err := seen(s.Publish(t.Context(), b.Refused(t)))
		if !outbox.IsPermanent(err) || outbox.IsUnavailable(err) {
			t.Errorf("got %v, want a permanent error", err)
		}
		closeSink(t, s)
	})

	// The sink, not the event, failed: the relay holds every event, their
	// attempts untouched, until the broker is back (outbox.IsUnavailable).
	unavailable := func(t *testing.T, err error) {
		t.Helper()
		switch {
		case err == nil || outbox.IsPermanent(err):
			t.Errorf("got %v, want a transient error", err)
		case b.ClassifiesUnavailable && !outbox.IsUnavailable(err):
			t.Errorf("got %v, want an error outbox.IsUnavailable reports", err)
		}
	}
	t.Run("an unreachable broker is unavailable", func(t *testing.T) {
		s := b.Unreachable(t, 200*time.Millisecond)
		unavailable(t, seen(s.Publish(t.Context(), Event("down", 0))))
		closeSink(t, s)
	})

	// An unknown outcome is not the event's failure either.
	t.Run("no confirmation within the publish timeout is unavailable", func(t *testing.T) {
		s := b.Silent(t, 200*time.Millisecond)
		unavailable(t, seen(s.Publish(t.Context(), Event("silent", 0))))
		closeSink(t, s)
	})

	t.Run("cancellation through ctx", func(t *testing.T) {
		// The publish timeout is far away: only ctx can end the wait.
		s := b.Silent(t, time.Hour)
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(50*time.Millisecond, cancel)
		err := seen(s.Publish(ctx, Event("silent", 1)))
		if !errors.Is(err, context.Canceled) || outbox.IsPermanent(err) {
			t.Errorf("got %v, want a transient error wrapping context.Canceled", err)
		}
		unavailable(t, err)
		closeSink(t, s)
	})

	t.Run("errors", func(t *testing.T) {
		if len(errs) == 0 {
			t.Fatal("no error was seen")
		}
		for _, err := range errs {
			if b.Secret != "" && strings.Contains(err.Error(), b.Secret) {
				t.Errorf("error quotes the secret: %v", err)
			}
			// A sink that names the earliest retry must name a real one.
			var ra *outbox.RetryAfterError
			if errors.As(err, &ra) && (ra.After <= 0 || outbox.IsPermanent(err)) {
				t.Errorf("RetryAfterError with After %s (permanent %v): %v", ra.After, outbox.IsPermanent(err), err)
			}
		}
	})
}

// CheckMessage reports how m differs from what event e must look like on
// the broker: message id, CloudEvents attributes, stored headers, body.
func CheckMessage(t testing.TB, m Message, e outbox.Event) {
	t.Helper()
	want := map[string]string{
		"specversion":     "1.0",
		"id":              e.EventID,
		"source":          e.AggregateType,
		"type":            e.EventType,
		"subject":         e.AggregateID,
		"time":            e.OccurredAt.UTC().Format(time.RFC3339Nano),
		"datacontenttype": "application/json",
	}
	if m.ID != e.EventID {
		t.Errorf("event %s: message id %q", e.EventID, m.ID)
	}
	for k, v := range want {
		if m.Attrs[k] != v {
			t.Errorf("event %s: CloudEvents %s = %q, want %q", e.EventID, k, m.Attrs[k], v)
		}
	}
	for k, v := range e.Headers {
		if m.Headers[k] != v {
			t.Errorf("event %s: header %s = %q, want %q", e.EventID, k, m.Headers[k], v)
		}
	}
	if string(m.Body) != string(e.Payload) {
		t.Errorf("event %s: body %s, want %s", e.EventID, m.Body, e.Payload)
	}
}

// closeSink calls the sink's optional Close, as startup does after the
// relay stopped.
func closeSink(t testing.TB, s outbox.Sink) {
	if c, ok := s.(interface{ Close(context.Context) error }); ok {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := c.Close(ctx); err != nil {
			t.Errorf("close: %v", err)
		}
	}
}

// Events returns n events over 1,000 aggregates, for a benchmark.
func Events(n int) []outbox.Event {
	events := make([]outbox.Event, n)
	for i := range events {
		events[i] = Event(fmt.Sprintf("order-%d", i%1000), i)
	}
	return events
}

// BenchPublish publishes events through s from inFlight goroutines at
// once, each waiting for its publish to return, as the relay's publishes in
// flight do, and reports the rate as msgs/s. The timer runs only while
// they publish. It reports the first error of each goroutine to b.
func BenchPublish(b *testing.B, s outbox.Sink, events []outbox.Event, inFlight int) {
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	for range inFlight {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < int64(len(events)); i = next.Add(1) - 1 {
				if err := s.Publish(context.Background(), events[i]); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(len(events))/b.Elapsed().Seconds(), "msgs/s")
}
