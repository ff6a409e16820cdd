package inbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker/internal/tasks"
)

// PermanentError marks a handler's failure that no retry can fix: the
// message is dead-lettered at once.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that the message is dead-lettered without retry.
func Permanent(err error) error { return &PermanentError{Err: err} }

func isPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// SQLHandler runs one configured statement per message, with the message
// bound as named parameters (never spliced into the text): @source, @id,
// @type, @order_key, @origin, @body, @body_json, @headers and @attempt.
type SQLHandler struct{ SQL string }

// Handle implements Handler.
func (h SQLHandler) Handle(ctx context.Context, tx pgx.Tx, m Message) error {
	_, err := tx.Exec(ctx, h.SQL, sqlArgs(m))
	return err
}

// Queue adds m's statement to b: a batch's statements go to the database
// in one round trip (batchQueuer).
func (h SQLHandler) Queue(b *pgx.Batch, m Message) { b.Queue(h.SQL, sqlArgs(m)) }

func sqlArgs(m Message) pgx.NamedArgs {
	args := pgx.NamedArgs{
		"source": m.Source, "id": m.ID, "type": m.Type, "order_key": m.OrderKey, "origin": m.Origin,
		"headers": headersJSON(m.Headers), "attempt": m.Attempt, "body": nil, "body_json": nil,
	}
	// Text and jsonb take no NUL: such a body is NULL rather than a
	// failure of every attempt.
	if utf8.Valid(m.Body) && bytes.IndexByte(m.Body, 0) < 0 {
		args["body"] = string(m.Body)
	}
	if json.Valid(m.Body) && !bytes.Contains(m.Body, []byte(`\u0000`)) {
		args["body_json"] = json.RawMessage(m.Body)
	}
	return args
}

// batchQueuer is a Handler whose work for a message is one statement: the
// work transaction sends a whole batch's in one round trip.
type batchQueuer interface {
	Queue(b *pgx.Batch, m Message)
}

// RiverHandler enqueues a River task of a configured kind per message, in
// the work transaction (tasks.Enqueue): its args are the message's body, a
// JSON object, and its metadata carries the message's key.
type RiverHandler struct {
	Kind  string
	Queue string
}

// Handle implements Handler.
func (h RiverHandler) Handle(ctx context.Context, tx pgx.Tx, m Message) error {
	var obj map[string]json.RawMessage
	if json.Unmarshal(m.Body, &obj) != nil {
		return Permanent(fmt.Errorf("the river handler needs a JSON object body for the task's args"))
	}
	meta, _ := json.Marshal(map[string]string{"inbox_source": m.Consumer, "msg_source": m.Source, "msg_id": m.ID})
	_, err := tasks.EnqueueJSON(ctx, tx, h.Kind, m.Body, &river.InsertOpts{Queue: h.Queue, Metadata: meta})
	return err
}
