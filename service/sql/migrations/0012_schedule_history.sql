-- Schedule edits tell the truth (issue 24, item 6).
-- A reminder's schedule history: every schedule it has had and when each was in force,
-- written by `relay reminders load` in the transaction that changes the schedule, so
-- `relay backfill` admits only what the reminder owed then. And the skip reason of an
-- admitted occurrence that an edit of the schedule no longer owes ('rescheduled').

CREATE TABLE reminder_schedules (
    id             bigserial PRIMARY KEY,
    reminder_id    text NOT NULL REFERENCES reminders (id) ON DELETE CASCADE,
    -- '-infinity': the reminder's first schedule, taken to hold before it was loaded
    -- (the ledger knows no older one).
    valid_from     timestamptz NOT NULL,
    valid_to       timestamptz,  -- NULL: in force now
    schedule_kind  text NOT NULL CHECK (schedule_kind IN ('once', 'daily', 'cron')),
    due_at         timestamptz,
    daily_at       time,
    cron           text,
    timezone       text NOT NULL,
    CHECK (valid_to IS NULL OR valid_to >= valid_from),
    CHECK ((schedule_kind = 'once') = (due_at IS NOT NULL)),
    CHECK ((schedule_kind = 'daily') = (daily_at IS NOT NULL)),
    CHECK ((schedule_kind = 'cron') = (cron IS NOT NULL))
);

-- One schedule in force per reminder.
CREATE UNIQUE INDEX reminder_schedules_current_idx ON reminder_schedules (reminder_id)
    WHERE valid_to IS NULL;
CREATE INDEX reminder_schedules_reminder_idx ON reminder_schedules (reminder_id, valid_from);

-- Reminders loaded before this migration: their schedule now is the only one known.
INSERT INTO reminder_schedules (reminder_id, valid_from, schedule_kind, due_at, daily_at, cron,
                                timezone)
SELECT id, '-infinity', schedule_kind, due_at, daily_at, cron, timezone FROM reminders;

ALTER TABLE deliveries DROP CONSTRAINT deliveries_skip_reason_check;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_skip_reason_check
    CHECK (skip_reason IN ('cancelled', 'stale', 'missed', 'catch_up_limit', 'truncated',
                           'paused', 'rescheduled'));
