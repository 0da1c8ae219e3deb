-- When rescue last republished a row's message. Rescue leaves a row alone for one rescue
-- interval after that, so repeated runs move on to other rows instead of piling copies
-- of the same ones into the queues.
ALTER TABLE deliveries ADD COLUMN rescued_at timestamptz;
