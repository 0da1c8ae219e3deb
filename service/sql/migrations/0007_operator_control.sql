-- Operators in control (issue 15): held runs and an audit of every run action, the
-- windows admission was paused (occurrences due inside one are skipped 'paused'), runs
-- of kind 'backfill', and dead letters dropped on purpose.

-- A held run's non-final deliveries are not sent: a message for one is parked without
-- counting an attempt until the run is released. NULL: not held.
ALTER TABLE publish_runs ADD COLUMN held_at timestamptz;
ALTER TABLE publish_runs DROP CONSTRAINT publish_runs_kind_check;
ALTER TABLE publish_runs ADD CONSTRAINT publish_runs_kind_check
    CHECK (kind IN ('publish', 'rescue', 'backfill'));

-- Who did what to a run, when, why and to how many rows (`relay status --run` shows it).
CREATE TABLE run_actions (
    id        bigserial PRIMARY KEY,
    run_id    bigint NOT NULL REFERENCES publish_runs (id),
    action    text NOT NULL CHECK (action IN ('hold', 'release', 'cancel', 'dead-letter')),
    operator  text NOT NULL,
    reason    text CHECK (length(reason) <= 500),
    rows      integer NOT NULL DEFAULT 0 CHECK (rows >= 0),
    at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX run_actions_run_idx ON run_actions (run_id, id);

-- Each pause of admission, closed by the resume that ended it. An occurrence due inside a
-- window is recorded skipped ('paused') and never sent by a later run.
CREATE TABLE admission_pauses (
    id          bigserial PRIMARY KEY,
    paused_at   timestamptz NOT NULL DEFAULT now(),
    paused_by   text,
    resumed_at  timestamptz,
    resumed_by  text,
    CHECK (resumed_at IS NULL OR resumed_at >= paused_at)
);
-- At most one open window.
CREATE UNIQUE INDEX admission_pauses_open_idx ON admission_pauses ((true)) WHERE resumed_at IS NULL;
-- A pause in force when this migration runs opens a window now.
INSERT INTO admission_pauses (paused_at, paused_by)
SELECT changed_at, changed_by FROM admission WHERE paused;

ALTER TABLE deliveries DROP CONSTRAINT deliveries_skip_reason_check;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_skip_reason_check
    CHECK (skip_reason IN ('cancelled', 'stale', 'missed', 'catch_up_limit', 'truncated',
                           'paused'));
CREATE INDEX deliveries_created_idx ON deliveries (created_at, id);

-- `relay replay --from queue --drop`: dead letters acknowledged without a replay.
ALTER TABLE replays ADD COLUMN dropped integer NOT NULL DEFAULT 0 CHECK (dropped >= 0);
ALTER TABLE replays DROP CONSTRAINT replays_source_check;
ALTER TABLE replays ADD CONSTRAINT replays_source_check
    CHECK (source IN ('dead-letter-queue', 'ledger', 'drop'));
