-- Destinations as first-class (issue 16): a registry of webhook destinations with their
-- state (enabled, or disabled with a reason and since when), their failure streak, their
-- options and their own signing secrets (encrypted, several during a rotation).
-- It replaces disabled_destinations (its rows move here; a view of the same name keeps
-- ad-hoc reads of it working).

CREATE TABLE destinations (
    id                 bigserial UNIQUE,
    url                text PRIMARY KEY CHECK (length(url) BETWEEN 1 AND 2048),
    state              text NOT NULL DEFAULT 'enabled' CHECK (state IN ('enabled', 'disabled')),
    disabled_reason    text CHECK (length(disabled_reason) <= 500),
    disabled_at        timestamptz,
    failure_streak     integer NOT NULL DEFAULT 0 CHECK (failure_streak >= 0),
    streak_started_at  timestamptz,  -- the first failed attempt of the current streak
    envelope           boolean NOT NULL DEFAULT false,  -- Standard Webhooks event envelope
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CHECK ((state = 'disabled') = (disabled_at IS NOT NULL)),
    CHECK ((state = 'disabled') = (disabled_reason IS NOT NULL)),
    CHECK ((failure_streak = 0) = (streak_started_at IS NULL))
);

-- A destination's signing secrets, encrypted (Fernet tokens; the key is a setting). The
-- current one has no expiry; a rotation gives the previous ones an expiry (the grace) and
-- adds a new current one. Every secret not yet expired signs every request.
CREATE TABLE destination_secrets (
    id          bigserial PRIMARY KEY,
    url         text NOT NULL REFERENCES destinations (url) ON DELETE CASCADE,
    encrypted   text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz
);
CREATE INDEX destination_secrets_url_idx ON destination_secrets (url);

INSERT INTO destinations (url, state, disabled_reason, disabled_at)
SELECT destination, 'disabled', reason, disabled_at FROM disabled_destinations;
-- Destinations in use are registered as they are written (without a secret of their own:
-- they keep being signed with RELAY_WEBHOOK_SIGNING_SECRETS until given one).
INSERT INTO destinations (url)
SELECT DISTINCT destination FROM reminders WHERE channel = 'webhook'
UNION
SELECT DISTINCT destination FROM deliveries
WHERE channel = 'webhook' AND destination IS NOT NULL
  AND state IN ('pending', 'queued', 'sending', 'retrying')
ON CONFLICT (url) DO NOTHING;

DROP TABLE disabled_destinations;
CREATE VIEW disabled_destinations AS
SELECT url AS destination, disabled_reason AS reason, disabled_at
FROM destinations WHERE state = 'disabled';

-- The event type of the optional envelope (default 'reminder.due' when NULL).
ALTER TABLE reminders ADD COLUMN event_type text
    CHECK (event_type ~ '^[A-Za-z0-9._-]{1,100}$');
ALTER TABLE deliveries ADD COLUMN event_type text
    CHECK (event_type ~ '^[A-Za-z0-9._-]{1,100}$');
