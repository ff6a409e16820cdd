package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/worker-dev/worker/internal/pgtest"
)

// AppendStd writes through database/sql what Append writes through pgx,
// in the caller's transaction, with the same rules.
func TestAppendStd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pdb := pgtest.New(t)
	db := stdlib.OpenDBFromPool(pdb.Pool)
	t.Cleanup(func() { _ = db.Close() })

	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	id, err := AppendStd(ctx, tx, NewEvent{AggregateType: "order", AggregateID: "1", EventType: "order.placed",
		Payload: json.RawMessage(`{"n":1}`), Headers: map[string]string{"traceparent": "00-1-2-01"}})
	if err != nil {
		t.Fatal(err)
	}
	var rerr *RuleError
	if _, err := AppendStd(ctx, tx, NewEvent{AggregateType: "order", EventType: "x", Payload: json.RawMessage(`{}`)}); !errors.As(err, &rerr) ||
		rerr.Constraint != "outbox_event_aggregate_id_not_empty" {
		t.Fatalf("empty aggregate_id: %v, want its *RuleError", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var traceparent string
	if err := pdb.Pool.QueryRow(ctx, "SELECT headers->>'traceparent' FROM outbox_event_state WHERE event_id = $1", id).Scan(&traceparent); err != nil || traceparent != "00-1-2-01" {
		t.Fatalf("event %s after commit: traceparent %q, %v", id, traceparent, err)
	}

	tx, err = db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := AppendStd(ctx, tx, NewEvent{AggregateType: "order", AggregateID: "2", EventType: "order.placed", Payload: json.RawMessage(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pdb.Pool.QueryRow(ctx, "SELECT count(*) FROM outbox_event_state WHERE aggregate_id = '2'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("rolled-back append: %d rows, %v; want none", n, err)
	}
}
