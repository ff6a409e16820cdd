-- +goose Up
-- Producer rules: an INSERT into outbox_event refuses, inside the
-- producer's transaction, a row the relay could not publish. Each rule is a
-- named CHECK constraint, so the error names what is wrong (SQLSTATE 23514,
-- constraint_name = the rule). docs/outbox.md lists them; the Go helper
-- (internal/outbox, rules.go) checks the same rules first, and a test runs
-- the same cases through both.
--
-- Each rule exempts rows the relay has already attempted (attempts > 0). A
-- CHECK is tested on every new row version, UPDATEs included, and a NOT
-- VALID constraint is no exception: without the exemption, the relay could
-- not record the outcome (PUBLISHED, FAILED, DEAD) of a row that predates
-- these rules, and the failing UPDATE would roll back its whole batch. The
-- insert trigger sets attempts to 0 before constraints are checked, so
-- every INSERT meets every rule; so does a DEAD event an operator requeues
-- (dead retry resets attempts), which has to be fixed or purged instead.
--
-- NOT VALID: rows already in the table are not checked, so this migration
-- never fails on old data and takes no table scan. The relay dead-letters
-- old rows it cannot read (an infinite occurred_at, say).
--
-- Limits are in bytes (UTF-8), so that with the id the entries of
-- outbox_event_aggregate_idx stay far below PostgreSQL's ~2700-byte btree
-- limit: 255 + 512 + 8 bytes at most.
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_aggregate_type_not_empty
        CHECK (attempts > 0 OR aggregate_type <> '') NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_id_not_empty
        CHECK (attempts > 0 OR aggregate_id <> '') NOT VALID,
    ADD CONSTRAINT outbox_event_event_type_not_empty
        CHECK (attempts > 0 OR event_type <> '') NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_type_length
        CHECK (attempts > 0 OR octet_length(aggregate_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_event_aggregate_id_length
        CHECK (attempts > 0 OR octet_length(aggregate_id) <= 512) NOT VALID,
    ADD CONSTRAINT outbox_event_event_type_length
        CHECK (attempts > 0 OR octet_length(event_type) <= 255) NOT VALID,
    -- Control characters: Unicode category Cc (C0, DEL, C1), by code point
    -- whatever the collation. NUL cannot be stored in text anyway.
    ADD CONSTRAINT outbox_event_aggregate_type_no_control
        CHECK (attempts > 0 OR aggregate_type !~ '[\u0001-\u001f\u007f-\u009f]') NOT VALID,
    ADD CONSTRAINT outbox_event_event_type_no_control
        CHECK (attempts > 0 OR event_type !~ '[\u0001-\u001f\u007f-\u009f]') NOT VALID,
    -- Finite and within years 0001-9999 (UTC): what RFC 3339 (ce-time) can
    -- express. 'infinity' and '-infinity' fail both comparisons.
    ADD CONSTRAINT outbox_event_occurred_at_range
        CHECK (attempts > 0 OR occurred_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00') NOT VALID,
    -- Header values are strings (headers is an object already:
    -- outbox_event_headers_object).
    ADD CONSTRAINT outbox_event_headers_strings
        CHECK (attempts > 0 OR NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")')) NOT VALID;

-- +goose Down
ALTER TABLE outbox_event
    DROP CONSTRAINT outbox_event_aggregate_type_not_empty,
    DROP CONSTRAINT outbox_event_aggregate_id_not_empty,
    DROP CONSTRAINT outbox_event_event_type_not_empty,
    DROP CONSTRAINT outbox_event_aggregate_type_length,
    DROP CONSTRAINT outbox_event_aggregate_id_length,
    DROP CONSTRAINT outbox_event_event_type_length,
    DROP CONSTRAINT outbox_event_aggregate_type_no_control,
    DROP CONSTRAINT outbox_event_event_type_no_control,
    DROP CONSTRAINT outbox_event_occurred_at_range,
    DROP CONSTRAINT outbox_event_headers_strings;
