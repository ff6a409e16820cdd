// Command inbox is the Go inbox handler of docs/inbox.md: the stock worker
// plus a handler that records a payment and announces it, both in the
// transaction that marks the message processed.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker"
	"github.com/worker-dev/worker/inbox"
	"github.com/worker-dev/worker/outbox"
)

type payment struct {
	Order  string `json:"order"`
	Amount int64  `json:"amount"`
}

func recordPayment(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	var p payment
	if err := json.Unmarshal(m.Body, &p); err != nil || p.Order == "" {
		return inbox.Permanent(errors.New("not a payment")) // no retry can fix it: dead letter now
	}
	if _, err := tx.Exec(ctx, `UPDATE orders SET paid_cents = $2 WHERE id = $1`, p.Order, p.Amount); err != nil {
		return err // rolled back; retried with backoff, then dead-lettered
	}
	// Committed with the payment and the message's dedupe record, or not at all.
	_, err := outbox.Append(ctx, tx, outbox.Event{
		AggregateType: "order", AggregateID: p.Order, EventType: "order.paid",
		Payload: m.Body, Headers: map[string]string{"causation_id": m.ID},
	})
	return err
}

func main() {
	os.Exit(worker.Run(os.Args[1:], worker.WithInboxHandler("record-payment", recordPayment)))
}
