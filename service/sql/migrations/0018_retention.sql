-- Retention (issue 27): final deliveries lose their content after a period, and their rows
-- after a longer one; runs and the audit trail have periods of their own. `relay purge`
-- does it in short batches (service/retention.py, service/purge_batches.py).

-- When a final delivery's content was purged: its payload, its recipient (e-mail, SMS: the
-- address or number; a webhook keeps its endpoint, a partner's, not a person's) and its
-- attempts' reply excerpts are gone; ids, state, times, counts and reasons stay, so the
-- run report and `relay deliveries show` still say who did not get it, and say that the
-- content was purged. Only a final row is purged, and a purged row never leaves its final
-- state (replay and backfill leave it alone).
-- IF NOT EXISTS: see the indexes below.
ALTER TABLE deliveries ADD COLUMN IF NOT EXISTS content_purged_at timestamptz;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_content_purged_final
    CHECK (content_purged_at IS NULL OR finished_at IS NOT NULL);
ALTER TABLE deliveries ADD CONSTRAINT deliveries_content_purged_no_payload
    CHECK (content_purged_at IS NULL OR payload IS NULL);
-- 0001's rule that an outbox row carries its destination and payload, now until its
-- content is purged: then the payload is gone, and the destination too unless a webhook's.
ALTER TABLE deliveries DROP CONSTRAINT deliveries_check6;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_outbox_content
    CHECK (source = 'schedule'
           OR (content_purged_at IS NULL AND destination IS NOT NULL AND payload IS NOT NULL)
           OR (content_purged_at IS NOT NULL
               AND (destination IS NULL) = (channel IN ('email', 'sms'))));

-- Purge finds final rows by channel and age without reading the table: those whose content
-- is still kept (a window of the content period), and every final row (for row purge and
-- the oldest-row gauge). (finished_at is set exactly when a row is final.) IF NOT EXISTS: on a
-- large ledger an operator may build these three beforehand with CREATE INDEX CONCURRENTLY
-- (docs/deploy.md, "Upgrade and rollback"), so the migration does not hold writes meanwhile.
CREATE INDEX IF NOT EXISTS deliveries_content_kept_idx ON deliveries (channel, finished_at, id)
    WHERE finished_at IS NOT NULL AND content_purged_at IS NULL;
CREATE INDEX IF NOT EXISTS deliveries_final_idx ON deliveries (channel, finished_at, id)
    WHERE finished_at IS NOT NULL;
-- Deleting a run action checks this foreign key: without an index, a scan of deliveries.
CREATE INDEX IF NOT EXISTS deliveries_stop_action_idx ON deliveries (stop_action_id)
    WHERE stop_action_id IS NOT NULL;
-- Likewise for deleting a delivery a suppression names (the receipt that added it).
CREATE INDEX suppressions_delivery_idx ON suppressions (delivery_id)
    WHERE delivery_id IS NOT NULL;

-- An event's payload goes with its deliveries' content (an event reaches webhooks only);
-- a subscription's backfill never reaches back past it.
ALTER TABLE events ALTER COLUMN payload DROP NOT NULL;
ALTER TABLE events ADD COLUMN content_purged_at timestamptz;
ALTER TABLE events ADD CONSTRAINT events_payload_until_purged
    CHECK ((payload IS NULL) = (content_purged_at IS NOT NULL));
CREATE INDEX events_content_kept_idx ON events (created_at, id) WHERE content_purged_at IS NULL;

-- A run whose delivery rows were purged keeps what became of them, so `relay status --run`
-- and `relay runs list` still count them: 'channel/state/skip reason' -> rows purged.
ALTER TABLE publish_runs ADD COLUMN purged_counts jsonb NOT NULL DEFAULT '{}'
    CHECK (jsonb_typeof(purged_counts) = 'object');

-- One row per `relay purge` (dry runs are not recorded): when, the policy it applied, and
-- what it purged ('table/content' or 'table/rows' -> rows). A run killed before it finished
-- stays 'running' until the next purge marks it 'interrupted'.
CREATE TABLE purge_runs (
    id           bigserial PRIMARY KEY,
    status       text NOT NULL DEFAULT 'running'
                 CHECK (status IN ('running', 'ok', 'interrupted', 'failed')),
    started_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    -- the time the periods were counted back from (the database's clock, or a test's)
    as_of        timestamptz NOT NULL,
    policy       jsonb NOT NULL CHECK (jsonb_typeof(policy) = 'object'),
    counts       jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(counts) = 'object'),
    batches      integer NOT NULL DEFAULT 0 CHECK (batches >= 0),
    host         text,
    error        text CHECK (length(error) <= 500),
    CHECK ((status = 'running') = (finished_at IS NULL))
);
CREATE INDEX purge_runs_ok_idx ON purge_runs (finished_at) WHERE status = 'ok';

-- What every purge ever removed, by table and kind ('content' or 'rows'): a counter that
-- only grows (the metric relay_purge_rows_total), kept apart from purge_runs, which the
-- audit period purges in turn. Written in each batch's own transaction.
CREATE TABLE purge_totals (
    table_name  text NOT NULL CHECK (length(table_name) BETWEEN 1 AND 64),
    kind        text NOT NULL CHECK (kind IN ('content', 'rows')),
    rows        bigint NOT NULL DEFAULT 0 CHECK (rows >= 0),
    PRIMARY KEY (table_name, kind)
);

-- How far back purges have reached, as the oldest time still whole: nothing finished
-- before rows_purged_before may still have its delivery row, no event created before
-- event_content_purged_before its payload. `relay backfill` and a subscription's backfill
-- refuse to reach back past them (an occurrence whose row was purged would be sent again).
-- Raised before the purge that reaches further; never lowered.
CREATE TABLE retention_horizon (
    singleton                    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    rows_purged_before           timestamptz,
    event_content_purged_before  timestamptz,
    installed_at                 timestamptz NOT NULL DEFAULT now()
);
INSERT INTO retention_horizon (singleton) VALUES (true);
