package worker

import (
	"context"
	"errors"

	ioutbox "github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/outbox"
)

var errNoJobRun = errors.New("worker: InTx needs the context of a Go job's run, whose lease fences the transaction")

// portSink is a public outbox.Sink seen by the relay.
type portSink struct{ s outbox.Sink }

func (p portSink) Name() string { return p.s.Name() }

func (p portSink) Publish(ctx context.Context, e ioutbox.Event) error {
	err := p.s.Publish(ctx, outbox.Message{
		EventID: e.EventID, AggregateType: e.AggregateType, AggregateID: e.AggregateID,
		EventType: e.EventType, Payload: e.Payload, Headers: e.Headers,
		OccurredAt: e.OccurredAt, Attempts: e.Attempts,
	})
	// The relay reads the retry time from its own type; err stays inside,
	// so that Permanent and Unavailable still show through.
	var ra *outbox.RetryAfterError
	if errors.As(err, &ra) {
		return &ioutbox.RetryAfterError{Err: err, After: ra.After}
	}
	return err
}

// Close closes the custom sink, if it has a Close method, after the relay
// has stopped.
func (p portSink) Close(ctx context.Context) error {
	if c, ok := p.s.(interface{ Close(context.Context) error }); ok {
		return c.Close(ctx)
	}
	return nil
}
