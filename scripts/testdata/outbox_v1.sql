-- Outbox storage V1: the outbox_event table, its sequence, indexes and
-- triggers as the migrations up to 00130 left them, the last schema before
-- storage V2 (00140). A fixture for scripts/bench-producer, which compares
-- producer inserts on it with storage V2; taken with pg_dump --schema-only
-- from a database migrated to version 130.

CREATE FUNCTION outbox_event_before_insert() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7304564, hashtext(NEW.aggregate_type || ':' || NEW.aggregate_id));
    NEW.id := nextval('outbox_event_id_seq');
    -- Relay-owned columns start clean whatever the producer sent.
    NEW.status := 'PENDING';
    NEW.attempts := 0;
    NEW.next_attempt_at := now();
    NEW.claimed_by := NULL;
    NEW.last_error := NULL;
    NEW.published_at := NULL;
    RETURN NEW;
END
$$;

CREATE FUNCTION outbox_event_notify() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('outbox_event', '');
    RETURN NULL;
END
$$;

CREATE TABLE outbox_event (
    id bigint NOT NULL,
    event_id uuid DEFAULT gen_random_uuid() NOT NULL,
    aggregate_type text NOT NULL COLLATE pg_catalog."C",
    aggregate_id text NOT NULL COLLATE pg_catalog."C",
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    occurred_at timestamp with time zone DEFAULT now() NOT NULL,
    status text DEFAULT 'PENDING'::text NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    next_attempt_at timestamp with time zone DEFAULT now() NOT NULL,
    claimed_by text,
    last_error text,
    published_at timestamp with time zone,
    CONSTRAINT outbox_event_headers_object CHECK ((jsonb_typeof(headers) = 'object'::text)),
    CONSTRAINT outbox_event_status_check CHECK ((status = ANY (ARRAY['PENDING'::text, 'IN_FLIGHT'::text, 'PUBLISHED'::text, 'FAILED'::text, 'DEAD'::text])))
);
CREATE SEQUENCE outbox_event_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;
ALTER SEQUENCE outbox_event_id_seq OWNED BY outbox_event.id;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_aggregate_id_length CHECK (((attempts > 0) OR (octet_length(aggregate_id) <= 512))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_aggregate_id_not_empty CHECK (((attempts > 0) OR (aggregate_id <> ''::text))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_aggregate_type_length CHECK (((attempts > 0) OR (octet_length(aggregate_type) <= 255))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_aggregate_type_no_control CHECK (((attempts > 0) OR (aggregate_type !~ '[\u0001-\u001f\u007f-\u009f]'::text))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_aggregate_type_not_empty CHECK (((attempts > 0) OR (aggregate_type <> ''::text))) NOT VALID;
ALTER TABLE ONLY outbox_event
    ADD CONSTRAINT outbox_event_event_id_key UNIQUE (event_id);
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_event_type_length CHECK (((attempts > 0) OR (octet_length(event_type) <= 255))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_event_type_no_control CHECK (((attempts > 0) OR (event_type !~ '[\u0001-\u001f\u007f-\u009f]'::text))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_event_type_not_empty CHECK (((attempts > 0) OR (event_type <> ''::text))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_headers_size CHECK (((attempts > 0) OR (octet_length((headers)::text) <= 16384))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_headers_strings CHECK (((attempts > 0) OR (NOT jsonb_path_exists(headers, '$.*?(@.type() != "string")'::jsonpath)))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_occurred_at_not_zero CHECK (((attempts > 0) OR (occurred_at <> '0001-01-01 00:00:00+00'::timestamp with time zone))) NOT VALID;
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_occurred_at_range CHECK (((attempts > 0) OR ((occurred_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (occurred_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)))) NOT VALID;
ALTER TABLE ONLY outbox_event
    ADD CONSTRAINT outbox_event_pkey PRIMARY KEY (id);
CREATE INDEX outbox_event_aggregate_idx ON outbox_event USING btree (aggregate_type, aggregate_id, id) WHERE (status = ANY (ARRAY['PENDING'::text, 'FAILED'::text, 'IN_FLIGHT'::text]));
CREATE INDEX outbox_event_dead_idx ON outbox_event USING btree (aggregate_type, aggregate_id, id) WHERE (status = 'DEAD'::text);
CREATE INDEX outbox_event_in_flight_idx ON outbox_event USING btree (next_attempt_at) WHERE (status = 'IN_FLIGHT'::text);
CREATE INDEX outbox_event_published_idx ON outbox_event USING btree (published_at) WHERE (status = 'PUBLISHED'::text);
CREATE INDEX outbox_event_unfinished_idx ON outbox_event USING btree (id) WHERE (status = ANY (ARRAY['PENDING'::text, 'FAILED'::text, 'IN_FLIGHT'::text]));
CREATE TRIGGER outbox_event_before_insert BEFORE INSERT ON outbox_event FOR EACH ROW EXECUTE FUNCTION outbox_event_before_insert();
CREATE TRIGGER outbox_event_notify AFTER INSERT ON outbox_event FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();
