-- When the broker confirmed the dead letter of a 'dead' row; NULL until then. A consumer
-- that died between the 'dead' write and the dead-letter publish leaves it NULL, and the
-- redelivered message publishes the missing dead letter instead of being acked silently.
ALTER TABLE deliveries ADD COLUMN dead_lettered_at timestamptz;
-- Rows that were dead before this column existed had their dead letter published.
UPDATE deliveries SET dead_lettered_at = coalesce(finished_at, now()) WHERE state = 'dead';
ALTER TABLE deliveries ADD CONSTRAINT dead_lettered_only_when_dead
    CHECK (dead_lettered_at IS NULL OR state = 'dead');
