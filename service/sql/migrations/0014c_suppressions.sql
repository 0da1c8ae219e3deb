-- Suppression (issue 26, item 3): addresses and numbers the provider said will not take
-- messages (a hard bounce, a complaint, a permanent SMS error) or that an operator added.
-- A later send to one is skipped ('suppressed') at the last check before its request.

-- The form an address is compared in: an e-mail address lower-cased (providers treat it
-- so), a number as written (E.164, checked when it entered). One definition, used by the
-- inserts and by the claim's and the send check's look-ups alike.
CREATE FUNCTION suppression_address(channel text, destination text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT CASE WHEN channel = 'email' THEN lower(destination) ELSE destination END $$;

CREATE TABLE suppressions (
    id              bigserial PRIMARY KEY,
    channel         text NOT NULL CHECK (channel IN ('email', 'sms')),
    address         text NOT NULL CHECK (length(address) BETWEEN 1 AND 2048),
    reason          text NOT NULL
                    CHECK (reason IN ('hard_bounce', 'complaint', 'undeliverable', 'operator')),
    detail          text CHECK (length(detail) <= 500),  -- the provider's code, the operator's why
    delivery_id     bigint REFERENCES deliveries (id),  -- whose receipt added it
    created_by      text NOT NULL CHECK (length(created_by) BETWEEN 1 AND 200),
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Lifted by an operator: kept, with who, when and why; it no longer suppresses.
    removed_at      timestamptz,
    removed_by      text CHECK (length(removed_by) BETWEEN 1 AND 200),
    removed_reason  text CHECK (length(removed_reason) BETWEEN 1 AND 500),
    CHECK (address = suppression_address(channel, address)),
    CHECK ((removed_at IS NULL) = (removed_by IS NULL)),
    CHECK ((removed_at IS NULL) = (removed_reason IS NULL)),
    CHECK ((reason = 'operator') = (delivery_id IS NULL))
);
-- At most one suppression in force per address; the look-up the last check makes.
CREATE UNIQUE INDEX suppressions_current_idx ON suppressions (channel, address)
    WHERE removed_at IS NULL;

ALTER TABLE deliveries DROP CONSTRAINT deliveries_skip_reason_check;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_skip_reason_check
    CHECK (skip_reason IN ('cancelled', 'stale', 'missed', 'catch_up_limit', 'truncated',
                           'paused', 'rescheduled', 'suppressed'));
