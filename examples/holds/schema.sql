-- The example application's own table (not part of the relay's schema): support holds
-- that expire unless confirmed in time. Apply it to the relay's database, after
-- `relay migrate`, so the expiry and its outbox intent share one transaction.

CREATE TABLE IF NOT EXISTS holds (
    id              bigserial PRIMARY KEY,
    customer_email  text NOT NULL CHECK (length(customer_email) BETWEEN 3 AND 320),
    state           text NOT NULL DEFAULT 'held'
                    CHECK (state IN ('held', 'confirmed', 'expired')),
    expires_at      timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- The expiry worker's scan: only holds still held, oldest expiry first.
CREATE INDEX IF NOT EXISTS holds_due_idx ON holds (expires_at) WHERE state = 'held';
