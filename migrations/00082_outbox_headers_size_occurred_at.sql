-- +goose Up
-- Two more producer rules, named CHECK constraints like those of
-- 00040_outbox_rules.sql (read its comment: the same attempts > 0
-- exemption, the same NOT VALID). internal/outbox/rules.go mirrors them.
--
-- outbox_event_headers_size: the headers object, as jsonb prints it, is at
-- most 16384 bytes. Every sink sends the stored headers beside its own
-- (ce-*, webhook-*, Nats-Msg-Id), and brokers bound the whole: NATS
-- JetStream refuses a message whose headers exceed 64 KiB, RabbitMQ a
-- header frame beyond its frame_max (128 KiB by default), and many HTTP
-- servers refuse requests whose headers pass 16 to 64 KiB. 16 KiB holds the largest
-- W3C baggage (8192 bytes) with traceparent and tracestate, and leaves
-- NATS room for the sink's own headers (aggregate_id percent-encoded is at
-- most 1536 bytes).
--
-- outbox_event_occurred_at_not_zero: 0001-01-01T00:00:00Z is the zero
-- value of Go's time.Time and of .NET's DateTime: a producer that writes
-- it forgot to set the time. Go's helper sends the zero time as "now()",
-- and the relay could not tell that instant from no time at all, so the
-- event would be published without ce-time. Any other instant of year 1
-- is accepted.
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_headers_size
        CHECK (attempts > 0 OR octet_length(headers::text) <= 16384) NOT VALID,
    ADD CONSTRAINT outbox_event_occurred_at_not_zero
        CHECK (attempts > 0 OR occurred_at <> '0001-01-01 00:00:00+00') NOT VALID;

-- +goose Down
ALTER TABLE outbox_event
    DROP CONSTRAINT outbox_event_headers_size,
    DROP CONSTRAINT outbox_event_occurred_at_not_zero;
