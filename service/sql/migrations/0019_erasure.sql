-- Erasure by recipient (issue 27, item 3): `relay erase --recipient ADDRESS|NUMBER|URL`
-- removes or irreversibly redacts one recipient's data from every table that can hold it
-- (the table-by-table list: service/erasure_columns.py), and records that it did so
-- without the recipient (a keyed hash of it).

-- When an erasure redacted this delivery (its destination, payload, last error and
-- receipt; its attempts' replies). An erased row is final and stays so: a replay or a
-- backfill never reopens it, and a late provider receipt never suppresses from it.
ALTER TABLE deliveries ADD COLUMN IF NOT EXISTS erased_at timestamptz;
-- (finished_at is set exactly when a row is final: deliveries_finished_when_final.)
ALTER TABLE deliveries ADD CONSTRAINT deliveries_erased_when_final
    CHECK (erased_at IS NULL OR finished_at IS NOT NULL);

-- A delivery not sent yet when its recipient was erased: skipped ('erased'), never sent.
ALTER TABLE deliveries DROP CONSTRAINT deliveries_skip_reason_check;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_skip_reason_check
    CHECK (skip_reason IN ('cancelled', 'stale', 'missed', 'catch_up_limit', 'truncated',
                           'paused', 'rescheduled', 'suppressed', 'erased'));

-- A reminder whose recipient was erased: kept as a tombstone (its id and schedule, no
-- destination, no payload), inactive for good. Nothing revives it: not a reminders file
-- line (a load leaves it as it is), not `reminders cancel`, not `destinations enable`.
ALTER TABLE reminders DROP CONSTRAINT reminders_inactive_reason_check;
ALTER TABLE reminders ADD CONSTRAINT reminders_inactive_reason_check
    CHECK (inactive_reason IN ('cancelled', 'destination_disabled', 'gone', 'erased'));

-- One row per applied erasure: which channel, a keyed hash of the normalised recipient
-- (HMAC-SHA256 with the deployment's console secret, the console's destination reference:
-- service/ops/console/refs.py), who, why, when and how many rows each table had changed.
-- Never the recipient: an erasure that kept the address would not be one.
CREATE TABLE erasures (
    id             bigserial PRIMARY KEY,
    channel        text NOT NULL CHECK (channel IN ('webhook', 'email', 'sms')),
    recipient_ref  text NOT NULL CHECK (recipient_ref ~ '^[0-9a-f]{16}$'),
    operator       text NOT NULL CHECK (length(operator) BETWEEN 1 AND 200),
    reason         text NOT NULL CHECK (length(reason) BETWEEN 1 AND 500),
    counts         jsonb NOT NULL CHECK (jsonb_typeof(counts) = 'object'),
    at             timestamptz NOT NULL DEFAULT now()
);
-- "Was this address erased, when, by whom?": the dry run of the same recipient answers.
CREATE INDEX erasures_ref_idx ON erasures (recipient_ref, id);
