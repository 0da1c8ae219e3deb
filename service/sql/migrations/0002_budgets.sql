-- Provider rate budgets shared by every consumer replica, and destinations disabled by a
-- receiver (410 Gone).

CREATE TABLE rate_budgets (
    provider         text PRIMARY KEY,
    rate_per_second  double precision CHECK (rate_per_second > 0),  -- NULL: no budget
    burst            double precision NOT NULL DEFAULT 1 CHECK (burst >= 1),
    tokens           double precision NOT NULL DEFAULT 0 CHECK (tokens >= 0),
    refilled_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    paused_until     timestamptz,  -- a throttle answer (429 + Retry-After) pauses everyone
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE disabled_destinations (
    destination  text PRIMARY KEY,
    reason       text NOT NULL,
    disabled_at  timestamptz NOT NULL DEFAULT now()
);
