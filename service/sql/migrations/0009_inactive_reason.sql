-- Why a reminder is inactive (issue 24, item 3), so that enabling a destination restores
-- only what disabling it paused and never what an operator cancelled; and a record of who
-- disabled or enabled a destination, when, why and with what effect.
--
--   cancelled             an operator stopped it (`relay reminders cancel`, or a reminders
--                         file line with "active": false); only a file line with
--                         "active": true brings it back
--   destination_disabled  paused because its destination was disabled (an operator, the
--                         console, a failure streak); `destinations enable` resumes it
--   gone                  paused because its destination answered 410 Gone; an operator
--                         enabling the destination says it is back, so enable resumes it too
ALTER TABLE reminders ADD COLUMN inactive_reason text
    CHECK (inactive_reason IN ('cancelled', 'destination_disabled', 'gone'));

-- Before this migration an inactive reminder was stopped either by an operator's cancel or
-- by a 410 Gone. A 410 deactivated its reminders in the transaction that disabled the
-- destination, so they carry that transaction's time (updated_at = disabled_at) while the
-- destination is still disabled as 410 gone. Every other inactive reminder is taken as
-- cancelled: enable must never revive it.
UPDATE reminders AS r SET inactive_reason = 'gone'
FROM destinations AS d
WHERE NOT r.active AND r.channel = 'webhook' AND d.url = r.destination
  AND d.state = 'disabled' AND d.disabled_reason = '410 gone' AND r.updated_at = d.disabled_at;
UPDATE reminders SET inactive_reason = 'cancelled' WHERE NOT active AND inactive_reason IS NULL;

-- A destination disabled now pauses its reminders, as every disable does from now on.
UPDATE reminders SET active = false, inactive_reason = 'destination_disabled'
WHERE active AND channel = 'webhook'
  AND destination IN (SELECT url FROM destinations WHERE state = 'disabled');

ALTER TABLE reminders ADD CONSTRAINT reminders_inactive_reason_active_check
    CHECK (active = (inactive_reason IS NULL));
-- Disable and enable find a destination's reminders without reading every reminder.
CREATE INDEX reminders_destination_idx ON reminders (destination);

-- An operator's disable or enable of a destination: who, when, why and what it did (for an
-- enable: how many reminders resumed, held deliveries sent or skipped, occurrences owed).
CREATE TABLE destination_actions (
    id        bigserial PRIMARY KEY,
    url       text NOT NULL REFERENCES destinations (url) ON DELETE CASCADE,
    action    text NOT NULL CHECK (action IN ('disable', 'enable')),
    operator  text NOT NULL CHECK (length(operator) BETWEEN 1 AND 200),
    reason    text NOT NULL CHECK (length(reason) BETWEEN 1 AND 500),
    effect    jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(effect) = 'object'),
    at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX destination_actions_url_idx ON destination_actions (url, id);
