package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/outbox"
)

// An order and its event, in one transaction: the event exists exactly
// when the order does.
func ExampleAppend() {
	place := func(ctx context.Context, db *pgx.Conn, orderID string) error {
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES ($1)", orderID); err != nil {
				return err
			}
			_, err := outbox.Append(ctx, tx, outbox.Event{
				AggregateType: "order",
				AggregateID:   orderID,
				EventType:     "order.placed",
				Payload:       json.RawMessage(`{"id":"` + orderID + `"}`),
			})
			return err
		})
	}
	_ = place
}

// An event that breaks a producer rule is refused before it reaches the
// database, with the rule named.
func ExampleRuleError() {
	_, err := outbox.Append(context.Background(), nil, outbox.Event{AggregateType: "order", EventType: "order.placed", Payload: json.RawMessage(`{}`)})
	var re *outbox.RuleError
	if errors.As(err, &re) {
		fmt.Println(re.Constraint)
	}
	// Output: outbox_event_aggregate_id_not_empty
}

// A sink that posts each event; its errors tell the relay whether the
// event or the sink failed.
func ExampleSink() {
	var _ outbox.Sink = postSink{}
}

type postSink struct{ url string }

func (postSink) Name() string { return "post" }

func (s postSink) Publish(ctx context.Context, m outbox.Message) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url, nil)
	if err != nil {
		return outbox.Permanent(err)
	}
	req.Header.Set("Idempotency-Key", m.EventID) // consumers dedupe on it
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err // a network error counts as the sink being unavailable
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusServiceUnavailable:
		return outbox.Unavailable(fmt.Errorf("%s answered %s", s.url, resp.Status))
	case resp.StatusCode == http.StatusTooManyRequests:
		return &outbox.RetryAfterError{Err: errors.New(resp.Status), After: 30 * time.Second}
	case resp.StatusCode >= 400 && resp.StatusCode < 500:
		return outbox.Permanent(fmt.Errorf("%s answered %s", s.url, resp.Status))
	case resp.StatusCode >= 300:
		return fmt.Errorf("%s answered %s", s.url, resp.Status) // counts one attempt
	}
	return nil
}

// Permanent sends the event to DEAD at once.
func ExamplePermanent() {
	err := outbox.Permanent(errors.New("payload has no customer"))
	fmt.Println(err)
	// Output: permanent: payload has no customer
}

// Unavailable keeps the event waiting, its attempts untouched.
func ExampleUnavailable() {
	err := outbox.Unavailable(errors.New("audit store is in maintenance"))
	fmt.Println(err)
	// Output: audit store is in maintenance
}

// A database/sql transaction appends the same way.
func ExampleAppendStd() {
	_ = outbox.AppendStd
}
