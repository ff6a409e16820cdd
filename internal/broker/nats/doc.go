// Package nats is the NATS JetStream wire convention both directions
// share: authentication and TLS options, the sorting of connect errors,
// subject name rules and escaping, and the CloudEvents binding (ce-
// headers, percent-encoded as in the HTTP binding) as an encode/decode
// pair. The outbox's sink (outbox/sink/nats) publishes with it, the
// inbox's source (inbox/source/nats) consumes with it.
package nats
