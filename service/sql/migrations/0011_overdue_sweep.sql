-- The consumers' overdue sweep (issue 24): a queued row whose message has not come (lost
-- from the timer ladder with its node, dropped between two levels, purged) is republished
-- seconds after it is overdue, not after the rescue delay. Each republish is stamped, so
-- one replica takes each row and the next sweep leaves it alone for an interval, and
-- counted, so the ledger says how often it happened.
ALTER TABLE deliveries ADD COLUMN republished_at timestamptz;
ALTER TABLE deliveries ADD COLUMN republishes integer NOT NULL DEFAULT 0
    CHECK (republishes >= 0);
ALTER TABLE deliveries ADD CONSTRAINT deliveries_republish_stamped
    CHECK ((republishes = 0) = (republished_at IS NULL));

-- The sweep's scan, every few seconds in every consumer: queued rows by due time.
CREATE INDEX deliveries_queued_due_idx ON deliveries (occurrence_at) WHERE state = 'queued';
