package tasks_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker/tasks"
)

type ReceiptArgs struct {
	OrderID int64 `json:"order_id"`
}

func (ReceiptArgs) Kind() string { return "send-receipt" }

// A task enqueued with the business change that causes it: it runs once
// the transaction commits, and never if it rolls back.
func ExampleEnqueue() {
	place := func(ctx context.Context, tx pgx.Tx, orderID int64) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES ($1)", orderID); err != nil {
			return err
		}
		_, err := tasks.Enqueue(ctx, tx, ReceiptArgs{OrderID: orderID}, &river.InsertOpts{Queue: "mail"})
		var rejected *tasks.RejectedError
		if errors.As(err, &rejected) {
			return fmt.Errorf("mail queue is full, try later: %w", err)
		}
		return err
	}
	_ = place
}

type badArgs struct{}

func (badArgs) Kind() string { return "send receipt" }

// A kind name River could never run is refused before the database is
// asked.
func ExampleKindNameError() {
	_, err := tasks.Enqueue(context.Background(), nil, badArgs{}, nil)
	var bad *tasks.KindNameError
	fmt.Println(errors.As(err, &bad), bad.Name)
	// Output: true send receipt
}
