// Package kafka is the Kafka wire convention both directions share: SASL
// and TLS options, the sorting of connect errors, topic name escaping, and
// the CloudEvents binding (ce_ headers, binary mode) as an encode/decode
// pair. The outbox's sink (outbox/sink/kafka) produces with it, the
// inbox's source (inbox/source/kafka) consumes with it.
package kafka
