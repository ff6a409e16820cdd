// Package producer is the producer side of docs/outbox.md and docs/tasks.md:
// a service that writes an outbox event or a task in the transaction of its
// own business writes.
package producer

import (
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/outbox"
)

// shipOrder appends order.shipped in the transaction that ships the order.
// tp is the caller's W3C traceparent, if any.
func shipOrder(ctx context.Context, pool *pgxpool.Pool, tp string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... business writes ...
		_, err := outbox.Append(ctx, tx, outbox.Event{
			AggregateType: "order",
			AggregateID:   "1001",
			EventType:     "order.shipped",
			Payload:       json.RawMessage(`{"carrier":"DHL"}`),
			Headers:       map[string]string{"traceparent": tp}, // optional
		})
		return err
	})
}
