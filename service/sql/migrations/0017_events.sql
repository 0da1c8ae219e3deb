-- Event types and subscriptions (issue 31): one business event reaches every partner that
-- subscribed to it. An application records an event (`outbox.add_event`) in its own
-- transaction; the same statement creates one delivery per subscribed destination, each
-- an ordinary outbox delivery (source 'outbox', its own destination, payload and key) that
-- names its event.

-- The catalogue partners choose from: a name, what it means, and optionally the JSON Schema
-- every payload of the type must satisfy (checked when the event is recorded).
CREATE TABLE event_types (
    -- dot-separated words, as the envelope's type allows: shipment.delayed
    name         text PRIMARY KEY
                 CHECK (length(name) <= 100 AND name ~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$'),
    description  text NOT NULL DEFAULT '' CHECK (length(description) <= 500),
    schema       jsonb CHECK (schema IS NULL OR jsonb_typeof(schema) IN ('object', 'boolean')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- A destination's choice of events: an exact type name, 'prefix.*' (every type under the
-- prefix) or '*' (every type); optionally a filter on top-level payload fields
-- ({"field": [allowed values], ...}: every field must equal one of its values); and the
-- rate budget (provider) its deliveries spend (NULL: the shared 'webhook' budget).
CREATE TABLE event_subscriptions (
    id          bigserial PRIMARY KEY,
    url         text NOT NULL REFERENCES destinations (url) ON DELETE CASCADE,
    pattern     text NOT NULL
                CHECK (pattern = '*' OR (length(pattern) <= 102
                       AND pattern ~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*(\.\*)?$')),
    filter      jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(filter) = 'object'),
    provider    text CHECK (provider ~ '^[A-Za-z0-9._-]{1,100}$'),
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (url, pattern)
);

-- Whether a subscription's pattern takes an event type: the one definition, used by the
-- fan-out, a backfill and the reports.
CREATE FUNCTION event_pattern_matches(pattern text, event_type text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pattern = event_type OR pattern = '*'
        OR (right(pattern, 2) = '.*' AND starts_with(event_type, left(pattern, -1)))
$$;

-- Whether a payload passes a subscription's filter: every field of the filter holds one of
-- its allowed values (a missing field is JSON null).
CREATE FUNCTION event_filter_matches(filter jsonb, payload jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT NOT EXISTS (
        SELECT 1 FROM jsonb_each(filter) AS f(field, allowed)
        WHERE NOT f.allowed @> jsonb_build_array(coalesce(payload -> f.field, 'null'::jsonb)))
$$;

-- One business event, as the application recorded it. Its key is the application's
-- business identity (unique: the same event recorded twice is one event); each delivery
-- of it is keyed 'event:<key>:<destination id>'.
CREATE TABLE events (
    id          bigserial PRIMARY KEY,
    key         text NOT NULL UNIQUE CHECK (length(key) BETWEEN 1 AND 256),
    event_type  text NOT NULL REFERENCES event_types (name),
    payload     jsonb NOT NULL CHECK (jsonb_typeof(payload) = 'object'),
    urgent      boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX events_type_created_idx ON events (event_type, created_at);
CREATE INDEX events_created_idx ON events (created_at);

-- The event a delivery carries (NULL: a reminder's occurrence or a single outbox intent).
ALTER TABLE deliveries ADD COLUMN event_id bigint REFERENCES events (id);
ALTER TABLE deliveries ADD CONSTRAINT deliveries_event_is_outbox
    CHECK (event_id IS NULL OR (source = 'outbox' AND channel = 'webhook'));
CREATE INDEX deliveries_event_idx ON deliveries (event_id) WHERE event_id IS NOT NULL;
