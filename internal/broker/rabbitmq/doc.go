// Package rabbitmq is the RabbitMQ (AMQP 0-9-1) wire convention both
// directions share: TLS for amqps:// URLs, the sorting of dial errors,
// routing key escaping, and the CloudEvents binding (cloudEvents:
// application properties) as an encode/decode pair. The outbox's sink
// (outbox/sink/rabbitmq) publishes with it, the inbox's source
// (inbox/source/rabbitmq) consumes with it.
package rabbitmq
