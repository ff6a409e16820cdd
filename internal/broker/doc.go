// Package broker holds what every broker package (broker/nats,
// broker/rabbitmq, broker/kafka, broker/webhook) shares: the kinds of
// connect failure, TLS from files, URL redaction, percent-encoding and
// the CloudEvents attributes each binding carries.
//
// The broker packages are imported by both directions, the outbox's sinks
// (outbox/sink/<name>) and the inbox's sources (inbox/source/<name>), so
// that each broker's wire convention is written once. They import neither
// outbox nor inbox; layout_test.go at the repository root keeps it so.
package broker
