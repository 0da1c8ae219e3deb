-- The example application's statements, as named blocks ("-- name: x") like the relay's
-- own service/sql/queries.sql. Each state change is one conditional UPDATE: its WHERE
-- clause is the state machine, and zero rows back means someone else won.

-- name: create_hold
INSERT INTO holds (customer_email, expires_at) VALUES ($1, $2) RETURNING id;

-- name: lock_due_holds
-- One batch. SKIP LOCKED lets several workers share the due holds without waiting on
-- each other, and skips a hold whose confirmation is in flight (it is not due for us).
SELECT id, customer_email, expires_at
FROM holds
WHERE state = 'held' AND expires_at <= $1
ORDER BY expires_at
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: expire_hold
UPDATE holds SET state = 'expired', updated_at = now()
WHERE id = $1 AND state = 'held'
RETURNING id;

-- name: confirm_hold
UPDATE holds SET state = 'confirmed', updated_at = now()
WHERE id = $1 AND state = 'held'
RETURNING id;
