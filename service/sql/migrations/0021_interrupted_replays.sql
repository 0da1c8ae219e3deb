-- A replay stopped by SIGTERM or SIGINT records what it did before it stopped (its
-- counts, its end) and says it was interrupted, instead of leaving its audit row at
-- 0 selected, 0 replayed and never finished.
ALTER TABLE replays ADD COLUMN interrupted boolean NOT NULL DEFAULT false;
