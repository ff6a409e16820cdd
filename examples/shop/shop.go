package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker"
	"github.com/worker-dev/worker/outbox"
	"github.com/worker-dev/worker/tasks"
)

// api is the shop's HTTP API:
//
//	POST /orders/{id}       places an order: the order row, an
//	                        order.placed event and a send-receipt task
//	POST /orders/{id}/ship  an order.shipped event
//
// ?fail=1 makes either handler fail after its writes, so its transaction
// rolls back.
func api(db *pgxpool.Pool) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		id := r.PathValue("id")
		respond(w, r, db, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO shop_order (id) VALUES ($1)", id); err != nil {
				return err
			}
			if err := appendEvent(ctx, tx, id, "order.placed"); err != nil {
				return err
			}
			_, err := tasks.Enqueue(ctx, tx, ReceiptArgs{OrderID: id}, nil)
			return err
		})
	})
	mux.HandleFunc("POST /orders/{id}/ship", func(w http.ResponseWriter, r *http.Request) {
		respond(w, r, db, func(ctx context.Context, tx pgx.Tx) error {
			return appendEvent(ctx, tx, r.PathValue("id"), "order.shipped")
		})
	})
	return mux
}

var errAsked = errors.New("failing as asked (?fail=1)")

// respond runs write in one transaction and answers 204, or 500 after a
// rollback.
func respond(w http.ResponseWriter, r *http.Request, db *pgxpool.Pool, write func(context.Context, pgx.Tx) error) {
	err := pgx.BeginFunc(r.Context(), db, func(tx pgx.Tx) error {
		if err := write(r.Context(), tx); err != nil {
			return err
		}
		if r.URL.Query().Get("fail") == "1" {
			return errAsked
		}
		return nil
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func appendEvent(ctx context.Context, tx pgx.Tx, orderID, eventType string) error {
	payload, err := json.Marshal(map[string]string{"order_id": orderID})
	if err != nil {
		return err
	}
	_, err = outbox.Append(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: orderID, EventType: eventType, Payload: payload})
	return err
}

// closeStaleOrders is the Go job: it closes orders older than a day,
// through InTx, so its writes commit only while it holds its lease. It
// records each sweep with the lease's fencing token.
func closeStaleOrders(ctx context.Context) error {
	if !schemaReady.Load() {
		return nil
	}
	return worker.InTx(ctx, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, "UPDATE shop_order SET closed = true WHERE NOT closed AND placed_at < now() - interval '1 day'")
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "INSERT INTO shop_sweep (fencing_token, closed) VALUES (current_setting('worker.fencing_token')::bigint, $1)", tag.RowsAffected())
		return err
	})
}

// ReceiptArgs are the send-receipt task's args.
type ReceiptArgs struct {
	OrderID string `json:"order_id"`
}

// Kind is the task kind.
func (ReceiptArgs) Kind() string { return "send-receipt" }

// ReceiptWorker is the Go task kind: it "sends" the receipt by recording
// it, with the task's id.
type ReceiptWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	DB *pgxpool.Pool
}

// Work records the receipt.
func (w *ReceiptWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	_, err := w.DB.Exec(ctx, "INSERT INTO shop_receipt (order_id, task_id) VALUES ($1, $2)", job.Args.OrderID, job.ID)
	return err
}

// ledgerSink is the custom sink: it copies each event into shop_ledger,
// a stand-in for a store the stock sinks do not reach.
type ledgerSink struct{ db *pgxpool.Pool }

func newLedgerSink(ctx context.Context, url string) (*ledgerSink, error) {
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	return &ledgerSink{db: db}, nil
}

func (*ledgerSink) Name() string { return "ledger" }

func (s *ledgerSink) Publish(ctx context.Context, m outbox.Message) error {
	_, err := s.db.Exec(ctx, "INSERT INTO shop_ledger (event_id, aggregate_id, event_type) VALUES ($1, $2, $3)", m.EventID, m.AggregateID, m.EventType)
	return err
}

// Close runs after the relay has stopped.
func (s *ledgerSink) Close(context.Context) error {
	s.db.Close()
	return nil
}
