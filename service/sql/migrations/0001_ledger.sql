-- The ledger: what was owed (reminders, deliveries) and what happened (attempts, runs).
-- Every state transition is a conditional UPDATE in service/sql/queries.sql; the CHECKs
-- below hold the invariants that tie columns to states.

CREATE TYPE delivery_state AS ENUM (
    'pending',    -- in the ledger, not yet confirmed by the broker
    'queued',     -- the broker confirmed a message for it
    'sending',    -- claimed by a consumer (leased)
    'retrying',   -- waiting for next_attempt_at
    'delivered',  -- accepted by the receiver (final)
    'dead',       -- rejected or out of attempts (final until replayed)
    'skipped'     -- not sent on purpose: cancelled, stale, missed (final)
);

CREATE TABLE reminders (
    id              text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 200),
    channel         text NOT NULL CHECK (channel IN ('webhook', 'email', 'sms')),
    destination     text NOT NULL CHECK (length(destination) BETWEEN 1 AND 2048),
    payload         jsonb NOT NULL CHECK (jsonb_typeof(payload) = 'object'),
    payload_version integer NOT NULL DEFAULT 1 CHECK (payload_version >= 1),
    schedule_kind   text NOT NULL CHECK (schedule_kind IN ('once', 'daily', 'cron')),
    due_at          timestamptz,
    daily_at        time,
    cron            text,
    timezone        text NOT NULL DEFAULT 'UTC',
    missed_policy   text NOT NULL DEFAULT 'catch_up'
                    CHECK (missed_policy IN ('catch_up', 'latest', 'skip')),
    stale_after     interval,
    send_stale      boolean NOT NULL DEFAULT false,
    urgent          boolean NOT NULL DEFAULT false,
    provider        text NOT NULL DEFAULT 'default',
    active          boolean NOT NULL DEFAULT true,
    next_due_at     timestamptz,  -- NULL: nothing more to fire
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((schedule_kind = 'once') = (due_at IS NOT NULL)),
    CHECK ((schedule_kind = 'daily') = (daily_at IS NOT NULL)),
    CHECK ((schedule_kind = 'cron') = (cron IS NOT NULL))
);

-- The publisher's scan: only active reminders with something left to fire.
CREATE INDEX reminders_due_idx ON reminders (next_due_at) WHERE active AND next_due_at IS NOT NULL;

CREATE TABLE publish_runs (
    id                bigserial PRIMARY KEY,
    kind              text NOT NULL CHECK (kind IN ('publish', 'rescue')),
    status            text NOT NULL DEFAULT 'running'
                      CHECK (status IN ('running', 'ok', 'incomplete', 'paused', 'failed')),
    intended_fire_at  timestamptz NOT NULL,
    started_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    due_count         integer NOT NULL DEFAULT 0,  -- occurrences owed (sent + skipped)
    created_count     integer NOT NULL DEFAULT 0,  -- ledger rows this run inserted
    skipped_count     integer NOT NULL DEFAULT 0,  -- of those, inserted as skipped (missed)
    published_count   integer NOT NULL DEFAULT 0,  -- confirmed by the broker
    rescued_count     integer NOT NULL DEFAULT 0,
    failed_count      integer NOT NULL DEFAULT 0,  -- left pending (not confirmed)
    error             text,
    host              text,
    CHECK ((status = 'running') = (finished_at IS NULL))
);

CREATE TABLE deliveries (
    id                 bigserial PRIMARY KEY,
    idempotency_key    text NOT NULL UNIQUE,
    reminder_id        text,  -- no FK: a delivery outlives a deleted reminder (-> skipped, cancelled)
    source             text NOT NULL DEFAULT 'schedule' CHECK (source IN ('schedule', 'outbox')),
    channel            text NOT NULL CHECK (channel IN ('webhook', 'email', 'sms')),
    provider           text NOT NULL DEFAULT 'default',
    destination        text,  -- outbox intents carry their own; schedule rows read the reminder
    payload            jsonb, -- likewise
    occurrence_at      timestamptz NOT NULL,
    urgent             boolean NOT NULL DEFAULT false,
    state              delivery_state NOT NULL DEFAULT 'pending',
    attempts           integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    round_start        integer NOT NULL DEFAULT 0 CHECK (round_start BETWEEN 0 AND attempts),
    replays            integer NOT NULL DEFAULT 0 CHECK (replays >= 0),
    next_attempt_at    timestamptz,
    lease_expires_at   timestamptz,
    last_status        integer,
    last_error         text CHECK (length(last_error) <= 500),
    receipt            text CHECK (length(receipt) <= 500),
    skip_reason        text CHECK (skip_reason IN ('cancelled', 'stale', 'missed', 'catch_up_limit',
                                                'truncated')),
    run_id             bigint REFERENCES publish_runs (id),
    created_at         timestamptz NOT NULL DEFAULT now(),
    published_at       timestamptz,
    first_attempt_at   timestamptz,
    finished_at        timestamptz,
    CHECK ((state IN ('delivered', 'dead', 'skipped')) = (finished_at IS NOT NULL)),
    CHECK ((state = 'sending') = (lease_expires_at IS NOT NULL)),
    CHECK ((state = 'retrying') = (next_attempt_at IS NOT NULL)),
    CHECK ((state = 'skipped') = (skip_reason IS NOT NULL)),
    CHECK (state <> 'delivered' OR attempts >= 1),
    CHECK (source = 'schedule' OR (destination IS NOT NULL AND payload IS NOT NULL))
);

CREATE INDEX deliveries_pending_idx ON deliveries (id) WHERE state = 'pending';
CREATE INDEX deliveries_open_idx ON deliveries (state, published_at)
    WHERE state IN ('queued', 'sending', 'retrying');
CREATE INDEX deliveries_run_idx ON deliveries (run_id, state);
CREATE INDEX deliveries_reminder_idx ON deliveries (reminder_id, occurrence_at);

CREATE TABLE delivery_attempts (
    delivery_id       bigint NOT NULL REFERENCES deliveries (id),
    attempt           integer NOT NULL CHECK (attempt >= 1),
    outcome           text NOT NULL
                      CHECK (outcome IN ('accepted', 'retry', 'throttled', 'rejected', 'skipped', 'lost')),
    http_status       integer,
    latency_ms        double precision,
    error             text CHECK (length(error) <= 500),
    response_excerpt  text CHECK (length(response_excerpt) <= 1000),
    payload_version   integer,
    started_at        timestamptz,
    finished_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (delivery_id, attempt)
);

-- One row: admission switch for `relay pause` / `relay resume`.
CREATE TABLE admission (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    paused     boolean NOT NULL DEFAULT false,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text
);
INSERT INTO admission (singleton) VALUES (true);

-- Audit of operator actions that move deliveries (replays).
CREATE TABLE replays (
    id           bigserial PRIMARY KEY,
    source       text NOT NULL CHECK (source IN ('dead-letter-queue', 'ledger')),
    operator     text NOT NULL,
    filters      jsonb NOT NULL,
    selected     integer NOT NULL DEFAULT 0,
    replayed     integer NOT NULL DEFAULT 0,
    started_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);
