-- Reconciliation of the duplicate window (issue 26, item 4). Before an e-mail or SMS is
-- sent again after an attempt whose request may have reached the provider unanswered (lost
-- with a crashed consumer; timed out or cut after connecting), the consumer asks the
-- provider whether that message exists, and records the answer and what it then did.

-- An attempt that sent nothing because the provider already had the message: the row is
-- accepted with that message's id, as if the lost attempt's answer had been read.
ALTER TABLE delivery_attempts DROP CONSTRAINT delivery_attempts_outcome_check;
ALTER TABLE delivery_attempts ADD CONSTRAINT delivery_attempts_outcome_check
    CHECK (outcome IN ('accepted', 'retry', 'throttled', 'rejected', 'skipped', 'lost',
                       'reconciled'));

CREATE TABLE reconciliations (
    id                   bigserial PRIMARY KEY,
    delivery_id          bigint NOT NULL REFERENCES deliveries (id),
    attempt              integer NOT NULL CHECK (attempt >= 1),  -- the claim that asked
    checked_attempts     integer[] NOT NULL CHECK (cardinality(checked_attempts) >= 1),
    -- found: the provider has the message (no resend); not_found: it has none (sent now);
    -- unknown: it could not say (the channel's policy decides)
    answer               text NOT NULL CHECK (answer IN ('found', 'not_found', 'unknown')),
    provider_message_id  text CHECK (length(provider_message_id) BETWEEN 1 AND 128),
    provider_status      text CHECK (length(provider_status) <= 64),
    -- what followed: no_resend (found), resend (not found), resend_same_key (unknown, e-mail:
    -- the provider's idempotency key makes a resend safe), hold (unknown, SMS: ask again
    -- later, send nothing meanwhile)
    policy               text NOT NULL
                         CHECK (policy IN ('no_resend', 'resend', 'resend_same_key', 'hold')),
    error                text CHECK (length(error) <= 200),
    asked_at             timestamptz NOT NULL DEFAULT now(),
    CHECK ((answer = 'found') = (provider_message_id IS NOT NULL)),
    CHECK ((answer = 'found') = (policy = 'no_resend')),
    CHECK (answer <> 'not_found' OR policy = 'resend')
);
CREATE INDEX reconciliations_delivery_idx ON reconciliations (delivery_id, id);
