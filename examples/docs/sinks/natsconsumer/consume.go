// Package natsconsumer is the consumer of docs/sinks.md's nats sink: it
// applies each event once, recording its id in the transaction that
// applies it, since JetStream redelivers what was not acknowledged.
package natsconsumer

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func consume(ctx context.Context, nc *nats.Conn, db *pgxpool.Pool) (jetstream.ConsumeContext, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, "OUTBOX", jetstream.ConsumerConfig{
		Durable:       "billing",
		FilterSubject: "outbox.order.>",
		AckPolicy:     jetstream.AckExplicitPolicy,
		MaxAckPending: 1, // one at a time keeps per-aggregate order on redelivery too
	})
	if err != nil {
		return nil, err
	}
	return cons.Consume(func(m jetstream.Msg) {
		id := m.Headers().Get("Nats-Msg-Id") // = ce-id = event_id
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, `INSERT INTO processed_event (event_id) VALUES ($1) ON CONFLICT DO NOTHING`, id)
			if err != nil || tag.RowsAffected() == 0 {
				return err // a duplicate: already applied
			}
			return apply(ctx, tx, m.Subject(), m.Data())
		})
		if err != nil {
			_ = m.Nak()
			return
		}
		_ = m.Ack()
	})
}

// apply is the consumer's own effect of an event, in the transaction that
// records the event as processed: both commit, or neither does.
func apply(ctx context.Context, tx pgx.Tx, subject string, data []byte) error {
	_, err := tx.Exec(ctx, `INSERT INTO billing_entry (subject, event) VALUES ($1, $2)`, subject, data)
	return err
}
