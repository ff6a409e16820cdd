package rabbitmq

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	rabbitmqbroker "github.com/worker-dev/worker/internal/broker/rabbitmq"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/obs"
)

// process hands ds to the inbox as one batch and settles each delivery
// with the broker as the inbox decides, after its commit.
func (s *Source) process(ctx context.Context, h inbox.Handoff, ds []amqp.Delivery) {
	var b busy
	batch := make([]*inbox.Delivery, len(ds))
	for i := range ds {
		batch[i] = &inbox.Delivery{Message: message(&ds[i], s.cfg.Queue), NativeID: ds[i].MessageId, Settle: b.settler(&ds[i])}
	}
	h.Process(ctx, batch)
	b.requeue(ctx)
}

// busy collects a batch's deliveries the inbox could not take now
// (another claim holds them, or the database is failing).
type busy struct {
	mu    sync.Mutex
	ds    []*amqp.Delivery
	after time.Duration
}

// settler returns d's Delivery.Settle: an outcome the inbox committed is
// acknowledged at once; a busy delivery waits for requeue.
func (b *busy) settler(d *amqp.Delivery) func(context.Context, inbox.Outcome, time.Duration) error {
	return func(_ context.Context, o inbox.Outcome, after time.Duration) error {
		switch o {
		case inbox.Processed, inbox.Duplicate, inbox.Dead:
			if err := d.Ack(false); err != nil {
				return fmt.Errorf("rabbitmq: ack delivery %d: %w", d.DeliveryTag, err)
			}
			return nil
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		b.ds = append(b.ds, d)
		b.after = max(b.after, after)
		return nil
	}
}

// requeue hands the busy deliveries back to the queue once the longest of
// their waits has passed. Requeued at once they would come straight back,
// and the consumer would spin on them; waiting here instead of consuming
// on also keeps the queue's order, which a single active consumer is
// there for. They go back in the order they came. If ctx ends first,
// closing the connection returns them.
func (b *busy) requeue(ctx context.Context) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.ds) == 0 || !obs.Sleep(ctx, b.after) {
		return
	}
	slices.SortFunc(b.ds, func(x, y *amqp.Delivery) int { return cmp.Compare(x.DeliveryTag, y.DeliveryTag) })
	for _, d := range b.ds {
		if d.Nack(false, true) != nil {
			return // the channel is gone, and with it every unacknowledged delivery
		}
	}
}

// message maps a delivery the way the outbox's rabbitmq sink publishes:
// its keys from the CloudEvents attributes (inbox.CloudEvent), which are
// application properties, message_id = the event id. The key is the
// CloudEvents id; message_id is the delivery's NativeID, which the inbox
// takes when the source configures no key of its own.
func message(d *amqp.Delivery, queue string) inbox.Message {
	h := make(map[string]string, len(d.Headers)+2)
	for k, v := range d.Headers {
		h[k] = rabbitmqbroker.Text(v)
	}
	// The message's own properties win over application properties that
	// borrow their names.
	if d.MessageId != "" {
		h["message_id"] = d.MessageId
	}
	if d.RoutingKey != "" {
		h["routing_key"] = d.RoutingKey
	}
	m := inbox.CloudEvent(rabbitmqbroker.Decode(d.Headers))
	m.Type = cmp.Or(m.Type, d.Type)
	m.Origin, m.Headers, m.Body = queue, h, d.Body
	return m
}
