// Package rabbitmqconsumer is the consumer of docs/sinks.md's rabbitmq
// sink: it applies each event once, recording its id in the transaction
// that applies it, since RabbitMQ redelivers and has no deduplication.
package rabbitmqconsumer

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
)

func consume(ctx context.Context, ch *amqp.Channel, db *pgxpool.Pool) error {
	// One unacked message at a time keeps per-aggregate order on redelivery.
	if err := ch.Qos(1, 0, false); err != nil {
		return err
	}
	msgs, err := ch.Consume("billing", "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	for d := range msgs {
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, `INSERT INTO processed_event (event_id) VALUES ($1) ON CONFLICT DO NOTHING`, d.MessageId)
			if err != nil || tag.RowsAffected() == 0 {
				return err // a duplicate: already applied
			}
			return apply(ctx, tx, d.Type, d.Body)
		})
		if err != nil {
			_ = d.Nack(false, true)
			continue
		}
		_ = d.Ack(false)
	}
	// The channel or its connection closed; the caller reconnects.
	return amqp.ErrClosed
}

// apply is the consumer's own effect of an event, in the transaction that
// records the event as processed: both commit, or neither does.
func apply(ctx context.Context, tx pgx.Tx, eventType string, body []byte) error {
	_, err := tx.Exec(ctx, `INSERT INTO billing_entry (event_type, event) VALUES ($1, $2)`, eventType, body)
	return err
}
