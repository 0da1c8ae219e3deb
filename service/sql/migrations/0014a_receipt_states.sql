-- Provider receipts (issue 26), part one: the states an e-mail or SMS delivery can be in
-- after its request. Added in a migration of their own: a new enum value cannot be used in
-- the transaction that adds it, and 0014b uses them in CHECK constraints.
--
--   accepted   the provider took the request (2xx) and no receipt has said more yet
--   delivered  (as before) webhooks: the receiver's own 2xx; e-mail, SMS: a receipt says
--              it arrived
--   bounced    a receipt says it did not arrive (an e-mail bounce; an SMS undelivered or
--              failed)
ALTER TYPE delivery_state ADD VALUE IF NOT EXISTS 'accepted' BEFORE 'delivered';
ALTER TYPE delivery_state ADD VALUE IF NOT EXISTS 'bounced' AFTER 'delivered';
