package nats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	natsbroker "github.com/worker-dev/worker/internal/broker/nats"
	"github.com/worker-dev/worker/internal/inbox"
)

// process hands one batch to the inbox and keeps its messages from
// redelivery while the inbox works on them. The messages the inbox left
// unsettled (ctx ended) are nak'd, so that another replica may take them
// at once rather than after ack_wait.
func (s *Source) process(ctx context.Context, h inbox.Handoff, msgs []jetstream.Msg, ackWait time.Duration, acks *ackLog) {
	batch := make([]*inbox.Delivery, len(msgs))
	for i, m := range msgs {
		batch[i] = delivery(m, acks)
	}
	stop := keepAlive(msgs, ackWait/3)
	h.Process(ctx, batch)
	stop()
	for _, m := range msgs {
		// An acked or nak'd message says so (ErrMsgAlreadyAckd) without
		// a word to the server.
		_ = m.Nak()
	}
}

// keepAlive sends an "in progress" ack for every message not yet settled,
// every interval, until stop is called: the inbox may hold a batch through
// retries and backoff longer than the consumer's ack wait.
func keepAlive(msgs []jetstream.Msg, interval time.Duration) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(max(interval, 10*time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			for _, m := range msgs {
				// Settled ones refuse locally (ErrMsgAlreadyAckd).
				if err := m.InProgress(); err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
					break // the connection is gone; the session ends after Process
				}
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

// delivery maps a message as the outbox's NATS sink publishes it: its
// keys from the CloudEvents attributes (inbox.CloudEvent). A message
// without ce-id keeps ID "": the inbox applies the source's configured
// key or dead-letters it, under its stream position.
func delivery(m jetstream.Msg, acks *ackLog) *inbox.Delivery {
	hdr := m.Headers()
	msg := inbox.CloudEvent(natsbroker.Decode(hdr))
	msg.Origin, msg.Headers, msg.Body = m.Subject(), make(map[string]string, len(hdr)), m.Data()
	for k, v := range hdr {
		msg.Headers[k] = strings.Join(v, ", ")
	}
	d := &inbox.Delivery{Message: msg, Settle: settle(m, acks)}
	if md, err := m.Metadata(); err == nil {
		d.Ref = fmt.Sprintf("%s/%d", md.Stream, md.Sequence.Stream)
	}
	return d
}

// settle acks what the inbox has decided (processed, duplicate, dead) and
// naks a busy message with the delay the inbox asks for. A fire-and-forget
// ack is enough: one lost redelivers the message, and the redelivery is a
// duplicate. An ack that cannot be sent (the connection is gone) is
// counted in acks, for one line when the session ends, not one per
// message.
func settle(m jetstream.Msg, acks *ackLog) func(context.Context, inbox.Outcome, time.Duration) error {
	return func(_ context.Context, o inbox.Outcome, after time.Duration) error {
		var err error
		switch o {
		case inbox.Processed, inbox.Duplicate, inbox.Dead:
			err = m.Ack()
		default:
			err = m.NakWithDelay(after)
		}
		if err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
			acks.lose(err)
		}
		return nil
	}
}

// ackLog counts the acks and naks a session could not send.
type ackLog struct {
	mu    sync.Mutex
	lost  int
	first error
}

func (a *ackLog) lose(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.lost == 0 {
		a.first = err
	}
	a.lost++
}

// reportLostAcks logs, once for a session, the acks it could not send:
// their messages come again after ack_wait, and the inbox answers them as
// duplicates. Acks the client had buffered when the connection was cut
// are lost too, without an error to count.
func (s *Source) reportLostAcks(acks *ackLog) {
	acks.mu.Lock()
	defer acks.mu.Unlock()
	if acks.lost == 0 {
		return
	}
	s.log.Warn("nats acknowledgements lost with the connection; the server redelivers those messages after ack_wait, and the inbox answers them as duplicates without running their work again",
		"acks_lost", acks.lost, "error", acks.first.Error())
	acks.lost, acks.first = 0, nil
}
