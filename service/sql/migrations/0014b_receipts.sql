-- Provider receipts (issue 26), part two: the provider's message id on each attempt, the
-- receipts themselves (append-only), and the CHECKs that tie the new states to the rows.

-- Final states now include accepted and bounced: finished_at is set exactly when a row is
-- final, and stays the time the provider accepted it (a receipt does not move it).
ALTER TABLE deliveries DROP CONSTRAINT deliveries_check1;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_finished_when_final
    CHECK ((state IN ('accepted', 'delivered', 'bounced', 'dead', 'skipped'))
           = (finished_at IS NOT NULL));
ALTER TABLE deliveries DROP CONSTRAINT deliveries_check5;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_attempted_when_sent
    CHECK (state NOT IN ('accepted', 'delivered', 'bounced') OR attempts >= 1);
-- Only channels with provider receipts wait for one; a webhook's 2xx is the receiver's word.
ALTER TABLE deliveries ADD CONSTRAINT deliveries_receipt_states_channels
    CHECK (state NOT IN ('accepted', 'bounced') OR channel IN ('email', 'sms'));

-- When a receipt settled the row (delivered or bounced by the provider's word). NULL for a
-- webhook delivered by its 2xx, and for every row not settled by a receipt.
ALTER TABLE deliveries ADD COLUMN settled_at timestamptz;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_settled_by_receipt
    CHECK (settled_at IS NULL OR (state IN ('delivered', 'bounced') AND channel IN ('email', 'sms')));
ALTER TABLE deliveries ADD CONSTRAINT deliveries_bounced_settled
    CHECK (state <> 'bounced' OR settled_at IS NOT NULL);

-- The provider's id of the message an attempt sent (Resend's email id, Twilio's SM sid):
-- what a receipt names.
ALTER TABLE delivery_attempts ADD COLUMN provider_message_id text
    CHECK (length(provider_message_id) BETWEEN 1 AND 128);
CREATE INDEX delivery_attempts_message_idx ON delivery_attempts (provider_message_id)
    WHERE provider_message_id IS NOT NULL;

-- One row per provider callback, never changed: what the provider said about one message
-- of one delivery (no message body, no address). A callback sent again (the provider's
-- retry, a replay within the signature's tolerance) is the same event_key: one row.
CREATE TABLE receipts (
    id                   bigserial PRIMARY KEY,
    delivery_id          bigint NOT NULL REFERENCES deliveries (id),
    channel              text NOT NULL CHECK (channel IN ('email', 'sms')),
    provider_message_id  text NOT NULL CHECK (length(provider_message_id) BETWEEN 1 AND 128),
    event_key            text NOT NULL CHECK (length(event_key) BETWEEN 1 AND 200),
    event                text NOT NULL CHECK (length(event) BETWEEN 1 AND 64),
    -- what the event says: sent (handed on, nothing known yet), delayed, delivered,
    -- bounced (did not arrive), complained (arrived; the recipient marked it as spam)
    outcome              text NOT NULL
                         CHECK (outcome IN ('sent', 'delayed', 'delivered', 'bounced', 'complained')),
    permanent            boolean NOT NULL DEFAULT false,  -- a hard bounce, a permanent SMS error
    reason               text CHECK (length(reason) <= 200),  -- the provider's raw code
    provider_at          timestamptz,
    received_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (channel, event_key),
    CHECK (NOT permanent OR outcome IN ('bounced', 'complained'))
);
CREATE INDEX receipts_delivery_idx ON receipts (delivery_id, id);

-- Append-only: a receipt is what a provider said; nothing rewrites it.
CREATE FUNCTION receipts_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'receipts are append-only';
END;
$$;
CREATE TRIGGER receipts_no_update BEFORE UPDATE ON receipts
    FOR EACH ROW EXECUTE FUNCTION receipts_append_only();

-- The run report's "accepted, no receipt after N minutes": accepted rows by age.
CREATE INDEX deliveries_accepted_idx ON deliveries (run_id, finished_at) WHERE state = 'accepted';
