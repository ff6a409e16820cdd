// Package kafkaconsumer is the consumer of docs/sinks.md's kafka sink: it
// applies each event once, recording its id in the transaction that
// applies it, since a group redelivers from its last committed offset.
package kafkaconsumer

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
)

func consume(ctx context.Context, db *pgxpool.Pool) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers("kafka:9092"), kgo.ConsumerGroup("billing"),
		kgo.ConsumeTopics("order"), kgo.DisableAutoCommit())
	if err != nil {
		return err
	}
	defer cl.Close()
	for {
		fs := cl.PollFetches(ctx)
		if err := fs.Err(); err != nil {
			return err // ctx is done, or an error the client does not retry
		}
		for _, r := range fs.Records() {
			var id string
			for _, h := range r.Headers {
				if h.Key == "ce_id" {
					id = string(h.Value)
				}
			}
			err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				tag, err := tx.Exec(ctx, `INSERT INTO processed_event (event_id) VALUES ($1) ON CONFLICT DO NOTHING`, id)
				if err != nil || tag.RowsAffected() == 0 {
					return err // a duplicate: already applied
				}
				return apply(ctx, tx, r.Value)
			})
			if err != nil {
				return err // nothing committed past it: the group starts again there
			}
		}
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			return err
		}
	}
}

// apply is the consumer's own effect of an event, in the transaction that
// records the event as processed: both commit, or neither does.
func apply(ctx context.Context, tx pgx.Tx, event []byte) error {
	_, err := tx.Exec(ctx, `INSERT INTO billing_entry (event) VALUES ($1)`, event)
	return err
}
