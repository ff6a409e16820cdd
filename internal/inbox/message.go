// Package inbox turns deliveries from a broker or a webhook into work done
// exactly once: each message's row in inbox_message is claimed, worked and
// turned PROCESSED in one transaction (for a handler declared to act
// outside the database, the claim commits first, so that a crash mid-work
// is found and handed to an operator). The source is acknowledged only
// after that commit, so a crash before it redelivers a message whose row
// says it is done, or that has no row at all, and the redelivery is a
// duplicate or simply runs again.
package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"time"

	"github.com/jackc/pgx/v5"
)

// Message is one message a source received.
type Message struct {
	// Consumer is the name of the inbox source it came through.
	Consumer string
	// Source and ID are its dedupe key: the CloudEvents source and id, or
	// "" and a configured header's or field's value for a foreign message.
	Source, ID string
	// Type is the CloudEvents type, if it has one.
	Type string
	// OrderKey names what the message belongs to (the CloudEvents source
	// and subject, the outbox's aggregate). Messages with one OrderKey in
	// one batch are processed in the order the source gave them.
	OrderKey string
	// Origin is where it came from: subject, topic, queue or path.
	Origin string
	// Headers are its headers or properties, as strings.
	Headers map[string]string
	// Body is its payload.
	Body []byte
	// Attempt is 1 on the first try of its work, 2 on the first retry.
	Attempt int
}

// Outcome is what became of a delivery.
type Outcome string

// Outcomes, the values of inbox_received_total's outcome label (Busy is
// not counted: the message comes again).
const (
	Processed Outcome = "processed" // its work committed now
	Duplicate Outcome = "duplicate" // its work had committed before, or an operator has it
	Failed    Outcome = "failed"    // its work failed and will be retried
	Dead      Outcome = "dead"      // dead-lettered: out of attempts, a permanent error, or no key
	Busy      Outcome = "busy"      // another claim holds it; deliver it again later
	// Unavailable is Busy for the database's sake: the inbox's
	// transaction failed, and the message comes again with its attempts
	// untouched. Sources treat it as Busy; the webhook says which.
	Unavailable Outcome = "unavailable"
)

// Final reports whether o is the inbox's decision about the message,
// counted in inbox_received_total, rather than a request to deliver it
// again later (Busy, Unavailable).
func (o Outcome) Final() bool { return o != Busy && o != Unavailable }

// Delivery is one message as a source hands it over, with the way back to
// the source.
type Delivery struct {
	Message Message
	// Invalid is set when the message cannot be processed at all: no
	// dedupe key, an unreadable envelope. It is dead-lettered with this
	// reason, under Ref.
	Invalid error
	// NativeID is the source's own message id (AMQP message_id), the
	// dedupe key of a message without a CloudEvents id when the source
	// configures no key of its own.
	NativeID string
	// Ref identifies the delivery in the source when the message has no
	// key (stream and sequence, topic, partition and offset). Empty means
	// a digest of the body.
	Ref string
	// Found is, when Settle is told Duplicate, the state the message's
	// row was found in: StateProcessed or StateResolved (done),
	// StateDead, or StateRecoveryRequired (an operator has it, and its
	// work may not have happened). A source that answers its sender (the
	// webhook) says which; the brokers acknowledge all alike.
	Found string
	// Settle tells the source what became of the message. It is called
	// once, after the commit that decided it: Processed, Duplicate and Dead
	// acknowledge; Busy asks for a redelivery no sooner than after.
	Settle func(ctx context.Context, o Outcome, after time.Duration) error
}

// key returns the row key of d: its dedupe key, or for an invalid message
// a key under which it is dead-lettered once.
func (d *Delivery) key() (source, id string) {
	if d.Invalid == nil {
		return d.Message.Source, d.Message.ID
	}
	ref := d.Ref
	if ref == "" {
		// A message without a key is known by its body; one whose key the
		// database cannot store, by that key (escaped) too, so that two
		// such messages with one body stay two.
		h := sha256.New()
		if d.Message.ID != "" {
			h.Write([]byte(d.Message.Source + "\x00" + d.Message.ID + "\x00"))
		}
		h.Write(d.Message.Body)
		ref = "sha256:" + hex.EncodeToString(h.Sum(nil))
	}
	return unkeyedSource, ref
}

// keyPair is key as a map key.
func (d *Delivery) keyPair() [2]string {
	s, i := d.key()
	return [2]string{s, i}
}

// unkeyedSource is msg_source for messages dead-lettered without a key.
const unkeyedSource = "!unkeyed"

// Handler does a message's work inside tx, the transaction that also marks
// the message processed. An error rolls the work back; the message is
// retried with backoff, then dead-lettered. Handlers should keep their
// effects inside tx: anything else they do may happen more than once, and
// a handler that does more must be declared effects: external.
type Handler interface {
	Handle(ctx context.Context, tx pgx.Tx, m Message) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, m Message) error

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, tx pgx.Tx, m Message) error { return f(ctx, tx, m) }

// Handoff is what a source hands its deliveries to: the Consumer.
type Handoff interface {
	// Process settles every delivery of batch before it returns (or when
	// ctx ends, leaving the rest for redelivery).
	Process(ctx context.Context, batch []*Delivery)
	// Up and Down report that the source is connected, or not: an outage
	// is logged once when it starts and once when it ends, never as the
	// messages' failure.
	Up()
	Down(err error)
}

// Source receives messages from a broker, or over HTTP.
type Source interface {
	// Run receives until ctx ends, handing batches to h. It returns nil
	// when ctx ends, or an error retrying cannot fix (bad setup).
	Run(ctx context.Context, h Handoff) error
}
