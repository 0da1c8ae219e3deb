-- An attempt sent although its occurrence was older than the reminder's stale_after
-- (send_stale): recorded, never silent.
ALTER TABLE delivery_attempts ADD COLUMN stale boolean NOT NULL DEFAULT false;
