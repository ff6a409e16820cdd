-- +goose NO TRANSACTION
-- +goose Up
-- Reclaiming a dead relay's detached events (internal/outbox, marker.go;
-- docs/outbox.md, "A relay that dies"). Each relay process holds a marker,
-- a shared session-level advisory lock (7304565, id) on its LISTEN
-- connection, and names it in claimed_by (token@id) when it detaches a
-- publish. When the marker's session ends, the other relays make that
-- owner's IN_FLIGHT events due at once instead of after in_flight_timeout.
--
-- Marker ids come from a sequence, so an id is never held by two relays
-- (until it wraps after two billion relay starts).
CREATE SEQUENCE IF NOT EXISTS outbox_relay_marker_seq AS integer CYCLE;

-- The reclaim finds a dead owner's IN_FLIGHT events through this index:
-- only IN_FLIGHT rows are in it (a few per publish slot), so the reclaim
-- costs the same whatever the backlog, and only a detach writes an entry.
-- Built CONCURRENTLY, hence outside a transaction: producers keep
-- inserting meanwhile however large the table. An earlier attempt that
-- failed part way leaves an invalid index of this name; drop it first.
DROP INDEX CONCURRENTLY IF EXISTS outbox_event_in_flight_idx;
CREATE INDEX CONCURRENTLY outbox_event_in_flight_idx ON outbox_event (next_attempt_at)
    WHERE status = 'IN_FLIGHT';

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS outbox_event_in_flight_idx;
DROP SEQUENCE IF EXISTS outbox_relay_marker_seq;
