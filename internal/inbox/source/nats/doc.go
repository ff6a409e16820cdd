// Package nats is the inbox source for NATS JetStream (inbox.sources[].kind:
// nats): a durable pull consumer with explicit ack. It fetches what is
// waiting, at most inbox.batch_size messages and at most the consumer's
// max_ack_pending (a pull for more would wait, until it expires, for acks
// that come only after this batch), hands them to the inbox, and acks each
// one only once the inbox has committed what became of it: processed, a
// duplicate or a dead letter. A message another replica holds (busy) is
// nak'd with the delay the inbox asks for. While the inbox works on a batch
// (retries with backoff included) the messages not yet settled are kept
// from redelivery with "in progress" acks, every ack_wait/3. So ack_wait
// (5s by default) bounds how long a dead replica's messages wait for the
// server to redeliver them, not how long work may take.
//
// The message's dedupe key is its ce-id and ce-source headers (the outbox's
// NATS sink sets them, percent-encoded as in the HTTP binding); its order
// key is ce-source/ce-subject, the outbox's aggregate.
//
// Order. The inbox processes a batch in order per aggregate, and a
// consumer hands out messages in stream order. With max_ack_pending = 1
// the consumer has one message out at a time, across every replica that
// shares it, so the stream's order holds (at the cost of one message per
// round trip). With a larger max_ack_pending, replicas fetch batches
// concurrently and a redelivery (after a nak or ack_wait) comes after
// later messages: messages of one aggregate may then be processed out of
// order across replicas and redeliveries.
//
// An outage (the server unreachable, a lost connection) is reported to the
// inbox as the source being down, never as a message's failure; the source
// reconnects with capped, jittered backoff until it answers. A server that
// stops answering without closing the connection (frozen) is found by the
// client's pings, within (maxPingsOut+1) × pingInterval. Acks that could
// not be sent make one log line per lost connection. Run returns an
// error only for what a retry cannot fix: refused credentials, unusable
// credential or TLS files, a missing stream or consumer.
package nats
