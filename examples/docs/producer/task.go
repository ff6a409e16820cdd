package producer

import (
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker/tasks"
)

// SendReceiptArgs are the args of a send-receipt task: a Go kind's args
// type, or for a configured kind any type with its name and JSON.
type SendReceiptArgs struct {
	Order int64 `json:"order"`
}

func (SendReceiptArgs) Kind() string { return "send-receipt" }

// placeOrder enqueues the receipt in the transaction of the order's own
// writes: both commit, or neither does.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, order int64, reqID string) error {
	// Marshalled, not concatenated: reqID often comes from a request header,
	// and a quote in it must not break the JSON or add keys to it.
	meta, err := json.Marshal(map[string]string{"request_id": reqID})
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... business writes ...
		_, err := tasks.Enqueue(ctx, tx, SendReceiptArgs{Order: order}, &river.InsertOpts{
			Metadata: meta, // optional: rides into the task's log lines
		})
		return err
	})
}
