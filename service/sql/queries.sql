-- Every statement the relay runs, as named blocks ("-- name: x"). DDL lives in migrations/.
-- A state transition is one conditional UPDATE: its WHERE clause is the state machine,
-- and zero rows back means "someone else won", never an error.

-- name: migrations_lock
SELECT pg_advisory_xact_lock(72177001);

-- name: migrations_table
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_applied
SELECT version FROM schema_migrations ORDER BY version;

-- name: migrations_present
-- Does the database have the relay's schema at all? (No error when it has not.)
SELECT to_regclass('schema_migrations') IS NOT NULL;

-- name: migrations_no_deadline
SET LOCAL statement_timeout = 0;

-- name: migrations_record
INSERT INTO schema_migrations (version) VALUES ($1);

-- name: db_now
SELECT now();

---------------------------------------------------------------------------- reminders

-- name: upsert_reminders
-- Load a file: one row per reminder, replacing schedule and content. next_due_at is kept
-- when the schedule did not change and the reminder is not cancelled, so a re-load never
-- re-fires an occurrence (and a paused reminder's missed ones are still judged by its
-- policy when it resumes); a changed payload bumps payload_version, which the consumer
-- records on the attempt. Run by service/edits.py, which also keeps the schedule history
-- and skips what a changed schedule no longer owes, in the same transaction. Whether it
-- is active, paused or cancelled is reminders_file_state's to say (run next, same tx). An
-- erased reminder (`relay erase`) is left as it is: a line never brings its recipient back.
INSERT INTO reminders AS r (id, channel, destination, payload, schedule_kind, due_at, daily_at,
                            cron, timezone, missed_policy, stale_after, send_stale, urgent,
                            provider, active, next_due_at, event_type)
SELECT t.id, t.channel, t.destination, t.payload, t.kind, t.due_at, t.daily_at, t.cron, t.tz,
       t.policy, t.stale_after, t.send_stale, t.urgent, t.provider, true, t.next_due_at,
       t.event_type
FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::text[], $6::timestamptz[],
            $7::time[], $8::text[], $9::text[], $10::text[], $11::interval[], $12::bool[],
            $13::bool[], $14::text[], $15::timestamptz[], $16::text[])
     AS t(id, channel, destination, payload, kind, due_at, daily_at, cron, tz, policy,
          stale_after, send_stale, urgent, provider, next_due_at, event_type)
ON CONFLICT (id) DO UPDATE SET
    channel = excluded.channel,
    destination = excluded.destination,
    payload = excluded.payload,
    payload_version = r.payload_version
        + (CASE WHEN r.payload IS DISTINCT FROM excluded.payload THEN 1 ELSE 0 END),
    schedule_kind = excluded.schedule_kind,
    due_at = excluded.due_at,
    daily_at = excluded.daily_at,
    cron = excluded.cron,
    timezone = excluded.timezone,
    missed_policy = excluded.missed_policy,
    stale_after = excluded.stale_after,
    send_stale = excluded.send_stale,
    urgent = excluded.urgent,
    provider = excluded.provider,
    event_type = excluded.event_type,
    next_due_at = CASE
        WHEN (r.schedule_kind, r.due_at, r.daily_at, r.cron, r.timezone)
             IS NOT DISTINCT FROM
             (excluded.schedule_kind, excluded.due_at, excluded.daily_at, excluded.cron,
              excluded.timezone)
             AND r.inactive_reason IS DISTINCT FROM 'cancelled'
        THEN r.next_due_at
        ELSE excluded.next_due_at END,
    updated_at = now()
WHERE r.inactive_reason IS DISTINCT FROM 'erased';

-- name: lock_reminder_schedules
-- A load's chunk: the schedules its reminders have now, locked in id order until the load
-- commits, so no publish run admits an occurrence of a schedule being replaced (admission
-- skips locked reminders) and the rows already admitted are all visible to the edit.
-- Erased ones are named: the load leaves them as they are.
SELECT id, schedule_kind, due_at, daily_at, cron, timezone,
       inactive_reason IS NOT DISTINCT FROM 'erased' AS erased
FROM reminders
WHERE id = ANY($1::text[])
ORDER BY id
FOR UPDATE;

-- name: reminders_erased
-- Which of these reminders ($1) were erased (`relay erase`): a load leaves their lines out.
SELECT id FROM reminders WHERE id = ANY($1::text[]) AND inactive_reason = 'erased';

-- name: record_schedules
-- The schedule history, after the upsert: reminders loaded for the first time ($1) start
-- theirs from -infinity; those whose schedule changed ($2) close the version in force at
-- $3 and open one from then, copied from the reminder row just written.
WITH closed AS (
    UPDATE reminder_schedules AS s SET valid_to = greatest(s.valid_from, $3)
    WHERE s.reminder_id = ANY($2::text[]) AND s.valid_to IS NULL
    RETURNING s.reminder_id, s.valid_to
)
INSERT INTO reminder_schedules (reminder_id, valid_from, schedule_kind, due_at, daily_at, cron,
                                timezone)
SELECT r.id, coalesce(c.valid_to, '-infinity'), r.schedule_kind, r.due_at, r.daily_at, r.cron,
       r.timezone
FROM reminders AS r
LEFT JOIN closed AS c ON c.reminder_id = r.id
WHERE r.id = ANY($1::text[]) OR r.id = ANY($2::text[]);

-- name: schedule_versions
-- One reminder's schedule history, oldest first (NULL valid_from: since before it was
-- loaded; NULL valid_to: in force now).
SELECT nullif(valid_from, '-infinity') AS valid_from, valid_to, schedule_kind, due_at,
       daily_at, cron, timezone
FROM reminder_schedules
WHERE reminder_id = $1
ORDER BY valid_from, id;

-- name: admitted_from
-- An edit of these reminders' schedules at $2: their admitted occurrences due from then on
-- that are not final and not in flight (the caller keeps those the new schedule owes).
SELECT id, reminder_id, occurrence_at FROM deliveries
WHERE reminder_id = ANY($1::text[]) AND source = 'schedule'
  AND state IN ('pending', 'queued', 'retrying') AND occurrence_at >= $2
ORDER BY id;

-- name: reminders_file_state
-- After a load: each line's reminder ($1) is active, paused or cancelled as its line ($2:
-- the line's "active", NULL when it has none) and its destination say. "active": false
-- cancels it; "active": true revives a cancelled one; without it a cancelled reminder stays
-- cancelled (a re-load never undoes an operator's cancel). A webhook reminder whose
-- destination is disabled is paused (`destinations enable` resumes it), whatever the line.
-- An erased reminder stays erased, whatever the line.
UPDATE reminders AS r SET active = s.reason IS NULL, inactive_reason = s.reason,
                          updated_at = now()
FROM (
    SELECT cur.id,
           CASE WHEN t.wanted IS FALSE
                     OR (t.wanted IS NULL AND cur.inactive_reason = 'cancelled')
                THEN 'cancelled'
                WHEN cur.channel = 'webhook'
                     AND EXISTS (SELECT 1 FROM destinations AS d
                                 WHERE d.url = cur.destination AND d.state = 'disabled')
                THEN CASE WHEN cur.inactive_reason = 'gone' THEN 'gone'
                          ELSE 'destination_disabled' END
           END AS reason
    FROM unnest($1::text[], $2::bool[]) AS t(id, wanted)
    JOIN reminders AS cur ON cur.id = t.id
    WHERE cur.inactive_reason IS DISTINCT FROM 'erased'
) AS s
WHERE r.id = s.id AND r.inactive_reason IS DISTINCT FROM s.reason;

-- name: list_reminders
SELECT id, channel, schedule_kind, daily_at, cron, timezone, due_at, next_due_at, active, urgent,
       missed_policy, payload_version, inactive_reason
FROM reminders
WHERE ($1::text IS NULL OR id > $1)
ORDER BY id
LIMIT $2;

-- name: get_reminder
SELECT id, channel, schedule_kind, due_at, daily_at, cron, timezone, missed_policy, stale_after,
       send_stale, urgent, provider, active, inactive_reason, next_due_at, payload_version,
       created_at, updated_at
FROM reminders WHERE id = $1;

-- name: cancel_reminder
-- An operator's cancel: no new occurrences; queued deliveries are skipped (cancelled) at
-- send time. A reminder paused by its destination's disable is cancelled too, so enabling
-- the destination leaves it cancelled. An erased reminder stays erased.
UPDATE reminders SET active = false, inactive_reason = 'cancelled', updated_at = now()
WHERE id = $1 AND (inactive_reason IS NULL OR inactive_reason NOT IN ('cancelled', 'erased'))
RETURNING id;

-- name: lock_due_reminders
-- One admission batch. SKIP LOCKED lets overlapping publish runs share the work
-- without waiting on each other's locks.
SELECT id, channel, provider, urgent, schedule_kind, due_at, daily_at, cron, timezone,
       missed_policy, next_due_at
FROM reminders
WHERE active AND next_due_at IS NOT NULL AND next_due_at <= $1
ORDER BY next_due_at
LIMIT $2
FOR UPDATE SKIP LOCKED;

-- name: oldest_due
SELECT min(next_due_at) FROM reminders WHERE active AND next_due_at <= $1;

-- name: advance_reminders
UPDATE reminders AS r SET next_due_at = t.next_due_at, updated_at = now()
FROM unnest($1::text[], $2::timestamptz[]) AS t(id, next_due_at)
WHERE r.id = t.id;

---------------------------------------------------------------------------- runs

-- name: start_run
-- The run's session locks the run's id (a session lock, taken in the statement that makes
-- the row visible): while the run's process lives, a look at pg_locks finds it.
WITH started AS (
    INSERT INTO publish_runs (kind, intended_fire_at, host)
    VALUES ($1, $2, $3)
    RETURNING id, started_at
)
SELECT id, started_at, pg_advisory_lock(72177028, (id % 2147483647)::int) FROM started;

-- name: run_unlock
SELECT pg_advisory_unlock(72177028, ($1::bigint % 2147483647)::int);

-- name: run_relock
-- A run whose lock went with its connection (a terminated backend, an idle-session
-- timeout) takes it again on another. A run starting meanwhile may have marked it
-- 'interrupted' (runs_interrupted's error, word for word): it is running after all. The
-- lock and the correction come in one statement, as in start_run.
WITH revived AS (
    UPDATE publish_runs SET status = 'running', finished_at = NULL, error = NULL
    WHERE id = $1 AND status = 'interrupted'
      AND error = 'ended before it finished (killed, or its database connection went away)'
    RETURNING id
)
SELECT pg_advisory_lock(72177028, ($1::bigint % 2147483647)::int),
       EXISTS (SELECT 1 FROM revived) AS revived;

-- name: runs_interrupted
-- Runs still 'running' whose lock no session holds: their process ended without recording
-- the end (SIGKILL, a deadline, a lost node). Their rows not published stay pending.
UPDATE publish_runs AS p
SET status = 'interrupted', finished_at = now(),
    error = 'ended before it finished (killed, or its database connection went away)'
WHERE p.status = 'running'
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks AS l
      WHERE l.locktype = 'advisory' AND l.database = (
                SELECT oid FROM pg_database WHERE datname = current_database())
        AND l.classid = 72177028 AND l.objid = (p.id % 2147483647)::oid AND l.objsubid = 2
        AND l.granted)
RETURNING p.id;

-- name: finish_run
UPDATE publish_runs SET
    status = $2, finished_at = now(), due_count = $3, created_count = $4, skipped_count = $5,
    published_count = $6, rescued_count = $7, failed_count = $8, error = $9
WHERE id = $1 AND status = 'running';

-- name: admission_paused
SELECT paused FROM admission;

-- name: set_admission
UPDATE admission SET paused = $1, changed_at = now(), changed_by = $2
RETURNING paused;

---------------------------------------------------------------------------- deliveries

-- name: insert_deliveries
-- The idempotency key is the business identity of an occurrence: a second discovery of
-- the same occurrence inserts nothing. Missed occurrences are inserted already skipped.
INSERT INTO deliveries (idempotency_key, reminder_id, channel, provider, occurrence_at, urgent,
                        state, skip_reason, finished_at, run_id)
SELECT t.key, t.reminder_id, t.channel, t.provider, t.occurrence_at, t.urgent,
       (CASE WHEN t.skip_reason IS NULL THEN 'pending' ELSE 'skipped' END)::delivery_state,
       t.skip_reason,
       CASE WHEN t.skip_reason IS NULL THEN NULL ELSE now() END,
       $8
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::bool[],
            $7::text[])
     AS t(key, reminder_id, channel, provider, occurrence_at, urgent, skip_reason)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, urgent, state, occurrence_at;

-- name: insert_outbox_intent
-- The outbox API: runs inside the caller's own transaction.
INSERT INTO deliveries (idempotency_key, source, channel, provider, destination, payload,
                        occurrence_at, urgent, event_type)
VALUES ($1, 'outbox', $2, $3, $4, $5, coalesce($6, now()), $7, $8)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: select_pending
-- Keyset pagination keeps each page small and the run's memory flat.
SELECT id, urgent, occurrence_at FROM deliveries
WHERE state = 'pending' AND id > $1
ORDER BY id
LIMIT $2;

-- name: mark_queued
-- Only after the broker confirmed: pending -> queued. A row a consumer already claimed
-- (its message overtook this update) is left alone. Rows are locked in id order, as every
-- statement that locks several deliveries does, so two such statements cannot deadlock.
WITH locked AS (
    SELECT id FROM deliveries
    WHERE id = ANY($1::bigint[]) AND state = 'pending'
    ORDER BY id
    FOR UPDATE
)
UPDATE deliveries AS d SET state = 'queued', published_at = now()
FROM locked
WHERE d.id = locked.id AND d.state = 'pending';

-- name: claim
-- Claim rows for sending: attempts + 1 and a lease. A 'sending' row whose lease expired
-- was held by a consumer that died; its unknown attempt is recorded as 'lost'. A row is
-- never claimed before its occurrence is due. Returns what the send needs and the facts
-- the pre-send checks read (with the database's clock), among them an operator's request
-- to stop the row (stop_action: its request was on the wire when the run was cancelled).
-- The claim stamps last_check_at: if the send waits for nothing, it is the last check.
WITH target AS (
    SELECT id, state AS prior_state
    FROM deliveries
    WHERE id = ANY($1::bigint[])
      AND ((state IN ('pending', 'queued') AND occurrence_at <= now())
           OR (state = 'retrying' AND next_attempt_at <= now())
           OR (state = 'sending' AND lease_expires_at <= now()))
    ORDER BY id
    FOR UPDATE
), claimed AS (
    UPDATE deliveries AS d SET
        state = 'sending',
        attempts = d.attempts + 1,
        lease_expires_at = now() + make_interval(secs => $2),
        next_attempt_at = NULL,
        first_attempt_at = coalesce(d.first_attempt_at, now()),
        published_at = coalesce(d.published_at, now()),
        last_check_at = now()  -- the claim reads every send fact: the last check until a wait
    FROM target AS t
    WHERE d.id = t.id
    RETURNING d.id, d.idempotency_key, d.reminder_id, d.source, d.channel, d.provider,
              d.destination, d.payload, d.occurrence_at, d.urgent, d.attempts, d.round_start,
              d.run_id, t.prior_state, d.event_type, d.stop_action_id
), lost AS (
    INSERT INTO delivery_attempts (delivery_id, attempt, outcome, error)
    SELECT id, attempts - 1, 'lost', 'lease expired before an outcome was written'
    FROM claimed WHERE prior_state = 'sending' AND attempts > 1
    ON CONFLICT DO NOTHING
)
SELECT c.id, c.idempotency_key, c.reminder_id, c.channel, c.provider, c.occurrence_at,
       c.urgent, c.attempts, c.round_start, c.run_id, c.prior_state::text AS prior_state,
       coalesce(c.destination, r.destination) AS destination,
       coalesce(c.payload, r.payload) AS payload,
       r.payload_version,
       -- not cancelled: a reminder paused by its destination's disable is held, not skipped
       (c.source = 'outbox' OR coalesce(r.active OR r.inactive_reason <> 'cancelled', false))
           AS active,
       extract(epoch FROM now() - c.occurrence_at)::float8 AS age_seconds,
       extract(epoch FROM r.stale_after)::float8 AS stale_after_seconds,
       coalesce(r.send_stale, false) AS send_stale,
       coalesce(dst.state = 'disabled', false) AS destination_disabled,
       coalesce(c.event_type, r.event_type) AS event_type,
       coalesce(dst.envelope, false) AS envelope,
       coalesce(dst.failure_streak, 0) AS failure_streak,
       coalesce((SELECT array_agg(s.encrypted ORDER BY s.id DESC)
                 FROM destination_secrets AS s
                 WHERE s.url = dst.url AND (s.expires_at IS NULL OR s.expires_at > now())),
                '{}') AS secrets,
       EXISTS (SELECT 1 FROM publish_runs AS p WHERE p.id = c.run_id AND p.held_at IS NOT NULL)
           AS run_held,
       ra.action AS stop_action, ra.reason AS stop_reason,
       greatest(0, extract(epoch FROM b.paused_until - clock_timestamp()))::float8
           AS provider_paused_seconds,
       EXISTS (SELECT 1 FROM suppressions AS s
               WHERE s.channel = c.channel AND s.removed_at IS NULL
                 AND s.address = suppression_address(c.channel, coalesce(c.destination, r.destination)))
           AS suppressed
FROM claimed AS c
LEFT JOIN reminders AS r ON r.id = c.reminder_id
LEFT JOIN run_actions AS ra ON ra.id = c.stop_action_id
LEFT JOIN rate_budgets AS b ON b.provider = c.provider
LEFT JOIN destinations AS dst
       ON dst.url = coalesce(c.destination, r.destination) AND c.channel = 'webhook';

-- name: unclaimable
-- Why the rows a claim did not take were not claimable, with the database's clock.
SELECT id, state::text AS state, next_attempt_at, lease_expires_at, now() AS now,
       attempts, last_status, last_error,
       (state = 'dead' AND dead_lettered_at IS NULL) AS dead_letter_missing,
       republishes > 0 AS republished,
       CASE WHEN state IN ('pending', 'queued')
            THEN greatest(0, extract(epoch FROM occurrence_at - now()))::float8
            ELSE 0 END AS early_seconds
FROM deliveries
WHERE id = ANY($1::bigint[]);

-- name: last_check
-- The last check before each request, after every wait (claims $1, each with the attempt
-- $2 it owns; a send that waited for nothing has its claim as last check). A row still
-- 'sending' under this very claim, its lease not run out and no operator's stop asked for, is stamped last_check_at: from now on its request may be on
-- the wire. The rows are locked in id order, as run_stop locks them, so the stamp and an
-- operator's cancel serialize on each row: either this check finds the row moved (and
-- nothing is sent) or the operator finds it stamped (on the wire). Returns every row as
-- the lock saw it, with what the send decision reads now.
WITH want AS (
    SELECT * FROM unnest($1::bigint[], $2::int[]) AS w(id, attempt)
), locked AS (
    SELECT id, state, attempts, lease_expires_at, stop_action_id, dead_lettered_at,
           last_error, source, reminder_id, channel, destination, occurrence_at, provider,
           run_id
    FROM deliveries
    WHERE id = ANY($1::bigint[])
    ORDER BY id
    FOR UPDATE
), stamped AS (
    UPDATE deliveries AS d SET last_check_at = clock_timestamp()
    FROM locked AS l JOIN want AS w ON w.id = l.id
    WHERE d.id = l.id AND l.state = 'sending' AND l.attempts = w.attempt
      AND l.lease_expires_at > now() AND l.stop_action_id IS NULL
    RETURNING d.id
)
SELECT l.id, l.state::text AS state, l.attempts, l.last_error,
       l.id IN (SELECT id FROM stamped) AS passed,
       coalesce(extract(epoch FROM l.lease_expires_at - clock_timestamp()), 0)::float8
           AS lease_left_seconds,
       (l.state = 'dead' AND l.dead_lettered_at IS NULL) AS dead_letter_missing,
       -- not cancelled: a reminder paused by its destination's disable is held, not skipped
       (l.source = 'outbox' OR coalesce(r.active OR r.inactive_reason <> 'cancelled', false))
           AS active,
       extract(epoch FROM now() - l.occurrence_at)::float8 AS age_seconds,
       extract(epoch FROM r.stale_after)::float8 AS stale_after_seconds,
       coalesce(r.send_stale, false) AS send_stale,
       EXISTS (SELECT 1 FROM destinations AS dd
               WHERE dd.url = coalesce(l.destination, r.destination) AND dd.state = 'disabled')
           AS destination_disabled,
       greatest(0, extract(epoch FROM b.paused_until - clock_timestamp()))::float8
           AS provider_paused_seconds,
       EXISTS (SELECT 1 FROM publish_runs AS p WHERE p.id = l.run_id AND p.held_at IS NOT NULL)
           AS run_held,
       ra.action AS stop_action, ra.reason AS stop_reason,
       EXISTS (SELECT 1 FROM suppressions AS s
               WHERE s.channel = l.channel AND s.removed_at IS NULL
                 AND s.address = suppression_address(l.channel, coalesce(l.destination, r.destination)))
           AS suppressed
FROM locked AS l
LEFT JOIN reminders AS r ON r.id = l.reminder_id
LEFT JOIN rate_budgets AS b ON b.provider = l.provider
LEFT JOIN run_actions AS ra ON ra.id = l.stop_action_id;

-- name: last_check_undo
-- Checks passed, but their requests must wait again (their budget tokens ran out meanwhile):
-- not on the wire while they wait. The next last check stamps them again, or stops them.
-- Locked in id order, as last_check and run_stop lock them.
WITH want AS (
    SELECT * FROM unnest($1::bigint[], $2::int[]) AS w(id, attempt)
), locked AS (
    SELECT id FROM deliveries WHERE id = ANY($1::bigint[]) ORDER BY id FOR UPDATE
)
UPDATE deliveries AS d SET last_check_at = NULL
FROM locked AS l JOIN want AS w ON w.id = l.id
WHERE d.id = l.id AND d.state = 'sending' AND d.attempts = w.attempt;

-- name: mark_dead_lettered
-- The dead letter of this death (the attempt that ended it) is confirmed by the broker.
UPDATE deliveries SET dead_lettered_at = now()
WHERE id = $1 AND state = 'dead' AND attempts = $2 AND dead_lettered_at IS NULL;

-- name: complete
-- Write the outcomes of many attempts, and their attempt rows, in one statement (one
-- round trip, atomic). The fence (state 'sending' and the attempt number this consumer
-- claimed) makes a late writer whose lease was taken over a no-op for the row; its
-- attempt row is still recorded (the send happened), replacing a 'lost' placeholder.
-- Returns (id, attempt) of every outcome that now stands: written by this statement, or
-- already written by this very attempt (a retry after a commit whose answer was lost).
WITH o AS (
    SELECT *
    FROM unnest($1::bigint[], $2::int[], $3::delivery_state[], $4::timestamptz[], $5::int[],
                $6::text[], $7::text[], $8::text[], $9::text[], $10::float8[], $11::text[],
                $12::text[], $13::int[], $14::timestamptz[], $15::bool[], $16::bool[],
                $17::text[])
         AS o(id, attempt, state, next_attempt_at, status, error, receipt, skip_reason,
              outcome, latency_ms, attempt_error, excerpt, payload_version, started_at, stale,
              possibly_delivered, provider_message_id)
), locked AS (
    SELECT id, state, attempts FROM deliveries
    WHERE id = ANY($1::bigint[])
    ORDER BY id
    FOR UPDATE
), updated AS (
    UPDATE deliveries AS d SET
        state = o.state,
        next_attempt_at = o.next_attempt_at,
        lease_expires_at = NULL,
        last_check_at = NULL,
        -- an operator's stop outlives a retry (never sent again), not the row's end
        stop_action_id = CASE WHEN o.state IN ('accepted', 'delivered', 'bounced', 'dead',
                                               'skipped') THEN NULL
                              ELSE d.stop_action_id END,
        last_status = o.status,
        last_error = o.error,
        receipt = coalesce(o.receipt, d.receipt),
        skip_reason = o.skip_reason,
        finished_at = CASE WHEN o.state IN ('accepted', 'delivered', 'dead', 'skipped')
                           THEN now() END
    FROM o JOIN locked AS l ON l.id = o.id
    WHERE d.id = o.id AND l.state = 'sending' AND l.attempts = o.attempt
    RETURNING d.id, o.attempt
), already AS (
    SELECT o.id, o.attempt FROM o JOIN locked AS l ON l.id = o.id
    WHERE l.state = o.state AND l.attempts = o.attempt AND l.state <> 'sending'
), recorded AS (
    INSERT INTO delivery_attempts (delivery_id, attempt, outcome, http_status, latency_ms,
                                   error, response_excerpt, payload_version, started_at, stale,
                                   possibly_delivered, provider_message_id)
    SELECT id, attempt, outcome, status, latency_ms, attempt_error, excerpt, payload_version,
           started_at, stale, possibly_delivered, provider_message_id
    FROM o WHERE outcome IS NOT NULL
    ON CONFLICT (delivery_id, attempt) DO UPDATE SET
        outcome = excluded.outcome, http_status = excluded.http_status,
        latency_ms = excluded.latency_ms, error = excluded.error,
        response_excerpt = excluded.response_excerpt,
        payload_version = excluded.payload_version, started_at = excluded.started_at,
        stale = excluded.stale, possibly_delivered = excluded.possibly_delivered,
        provider_message_id = excluded.provider_message_id,
        finished_at = now()
)
SELECT id, attempt FROM updated
UNION
SELECT id, attempt FROM already;

-- name: release
-- Give a claim back without counting an attempt: the request was never made (budget
-- paused for long, circuit open, destination share full, shutdown). With a time, the row
-- waits for it as 'retrying'; without one it is 'queued' again, due now.
UPDATE deliveries SET
    state = (CASE WHEN $3::timestamptz IS NULL THEN 'queued' ELSE 'retrying' END)::delivery_state,
    attempts = attempts - 1, lease_expires_at = NULL, next_attempt_at = $3, last_check_at = NULL,
    published_at = CASE WHEN $3::timestamptz IS NULL THEN now() ELSE published_at END
WHERE id = $1 AND state = 'sending' AND attempts = $2
RETURNING id;

-- name: select_rescue
-- Rows whose message should have arrived long ago: lost by the broker, purged, or held by
-- a consumer that died. Rows never rescued first, then the longest since their last
-- rescue, each group oldest overdue first across every state; a row rescued within the
-- interval is left alone, so one run's republish is not repeated by the next, and so is a
-- row the consumers' overdue sweep republished within it (stamp_overdue).
SELECT id, urgent FROM (
    SELECT id, urgent, rescued_at,
           CASE state WHEN 'queued' THEN greatest(published_at, occurrence_at)
                                         + make_interval(secs => $1)
                      WHEN 'retrying' THEN next_attempt_at + make_interval(secs => $1)
                      ELSE lease_expires_at END AS rescue_due_at
    FROM deliveries
    WHERE state IN ('queued', 'retrying', 'sending')
      AND (rescued_at IS NULL OR rescued_at < now() - make_interval(secs => $1))
      AND (republished_at IS NULL OR republished_at < now() - make_interval(secs => $1))
) AS open
WHERE rescue_due_at < now()
ORDER BY rescued_at NULLS FIRST, rescue_due_at, id
LIMIT $2;

-- name: mark_rescued
-- After a rescue publish was confirmed: stamp the rows, so the next rescue moves on.
-- Locked in id order, like every statement that locks several deliveries.
WITH locked AS (
    SELECT id FROM deliveries
    WHERE id = ANY($1::bigint[]) AND state IN ('queued', 'retrying', 'sending')
    ORDER BY id
    FOR UPDATE
)
UPDATE deliveries AS d SET rescued_at = now()
FROM locked
WHERE d.id = locked.id;

-- name: overdue_exists
-- Is a queued row overdue for the consumers' sweep (see stamp_overdue)? The cheap check each
-- consumer runs every few seconds, answered from the index on queued rows' due times.
SELECT EXISTS (
    SELECT 1 FROM deliveries
    WHERE state = 'queued'
      AND occurrence_at < now() - make_interval(secs => $1)
      AND coalesce(published_at, occurrence_at) < now() - make_interval(secs => $1)
      AND (republished_at IS NULL OR republished_at < now() - make_interval(secs => $1))
      AND (rescued_at IS NULL OR rescued_at < now() - make_interval(secs => $1))
);

-- name: stamp_overdue
-- Queued rows whose message should have reached a lane $1 s ago (counted from the due time,
-- or from the publication if later: a replayed or handed-back row) and that no consumer
-- claimed: stamp them republished, oldest due first, at most $2; the caller republishes
-- what this returns. A row stamped (or rescued) within the last $1 s is left alone.
-- SKIP LOCKED: the sweeps of other replicas take other rows, a row being claimed right now
-- is left to its claim, and as this never waits it cannot deadlock with statements that
-- lock in id order. copy_unclaimed: a sweep's copy of this row (since its last
-- publication) did not reach a consumer either.
WITH overdue AS (
    SELECT id, republished_at, coalesce(published_at, occurrence_at) AS last_published
    FROM deliveries
    WHERE state = 'queued'
      AND occurrence_at < now() - make_interval(secs => $1)
      AND coalesce(published_at, occurrence_at) < now() - make_interval(secs => $1)
      AND (republished_at IS NULL OR republished_at < now() - make_interval(secs => $1))
      AND (rescued_at IS NULL OR rescued_at < now() - make_interval(secs => $1))
    ORDER BY occurrence_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE deliveries AS d SET republished_at = now(), republishes = d.republishes + 1
FROM overdue
WHERE d.id = overdue.id AND d.state = 'queued'
RETURNING d.id, d.urgent,
          coalesce(overdue.republished_at >= overdue.last_published, false) AS copy_unclaimed;

-- name: open_owed_count
-- Rows whose message should be in a queue now (what rescue compares the queues against).
SELECT count(*) FROM deliveries WHERE state IN ('queued', 'retrying', 'sending');

---------------------------------------------------------------------------- status

-- name: runs_recent
SELECT id, kind, status, intended_fire_at, started_at, finished_at, due_count, created_count,
       skipped_count, published_count, rescued_count, failed_count, error, held_at,
       purged_counts
FROM publish_runs
WHERE ($1::bigint IS NULL OR id = $1) AND ($3::text IS NULL OR kind = $3)
  AND (NOT $4::bool OR created_count > 0)
ORDER BY id DESC
LIMIT $2;

-- name: latest_publish_run
-- The latest run that admitted anything: at 07:15 the 07:00 run, not the empty 07:15 one.
SELECT max(id) FROM publish_runs WHERE kind = 'publish' AND created_count > 0;

-- name: newest_publish_run
-- The newest publish run, whether it admitted anything or not: an empty run still proves the
-- CronJob runs, and that nothing due was waiting (its lag). Newest by id (the primary key's
-- index), not a scan.
SELECT started_at, intended_fire_at FROM publish_runs WHERE kind = 'publish'
ORDER BY id DESC LIMIT 1;

-- name: run_state_counts
SELECT run_id, state::text AS state, coalesce(skip_reason, '') AS skip_reason, count(*) AS n,
       min(CASE WHEN state = 'pending' THEN created_at END) AS oldest_pending,
       count(*) FILTER (WHERE content_purged_at IS NOT NULL) AS content_purged
FROM deliveries
WHERE run_id = ANY($1::bigint[])
GROUP BY run_id, state, skip_reason;

-- name: run_purged_counts
SELECT purged_counts FROM publish_runs WHERE id = $1;

-- name: run_lateness
-- How late each run's deliveries were: from the occurrence's due time to the receiver's
-- acceptance (the outcome written), over the rows sent: delivered, and e-mail and SMS the
-- provider accepted (a receipt later does not move finished_at).
SELECT run_id,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY late)::float8 AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY late)::float8 AS p95,
       max(late)::float8 AS max
FROM (SELECT run_id, extract(epoch FROM finished_at - occurrence_at) AS late
      FROM deliveries
      WHERE run_id = ANY($1::bigint[]) AND state IN ('accepted', 'delivered', 'bounced')) AS d
GROUP BY run_id;

-- name: overall_state_counts
SELECT state::text AS state, count(*) AS n FROM deliveries GROUP BY state;

-- name: outbox_state_counts
-- Outbox intents belong to no publish run: the report lists them on their own, and an
-- event's deliveries ($1 true) apart from single intents ($1 false).
SELECT state::text AS state, count(*) AS n,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending'))::float8
           AS oldest_pending_seconds
FROM deliveries WHERE source = 'outbox' AND (event_id IS NOT NULL) = $1 GROUP BY state;

-- name: oldest_claimable_age
-- Age of the oldest row that could be worked now (not rows waiting for their retry time).
SELECT extract(epoch FROM now() - min(coalesce(published_at, created_at)))::float8
FROM deliveries
WHERE state IN ('pending', 'queued')
   OR (state = 'retrying' AND next_attempt_at <= now());

-- name: run_missing
-- Who did not get it: every delivery of the run not delivered yet (or never).
SELECT d.id, d.reminder_id, d.channel, d.state::text AS state, d.last_status, d.last_error,
       d.next_attempt_at, d.skip_reason, d.attempts, d.occurrence_at,
       CASE WHEN d.state = 'accepted' THEN extract(epoch FROM now() - d.finished_at)::float8
            END AS accepted_seconds,
       d.content_purged_at
FROM deliveries AS d
WHERE d.run_id = $1 AND d.state <> 'delivered'
ORDER BY d.id
LIMIT $2;

-- name: open_count
-- Deliveries with work left (the demo waits for zero).
SELECT count(*) FROM deliveries WHERE state IN ('pending', 'queued', 'sending', 'retrying');

---------------------------------------------------------------------------- demo

-- name: demo_drop_database
-- {database}: one demo run's own database (relay_demo_<hex>, named and quoted by
-- service/ops/demo.py: an identifier cannot be a parameter).
DROP DATABASE IF EXISTS {database} WITH (FORCE);

-- name: demo_create_database
CREATE DATABASE {database};

---------------------------------------------------------------------------- replay

-- name: replay_select
-- Ledger replay: one page of rows matching the operator's filters (NULL = any). A row whose
-- content retention purged is never replayed (its payload, or its replies, are gone).
SELECT id, state::text AS state, urgent, reminder_id, idempotency_key, last_status
FROM deliveries
WHERE state = ANY($1::delivery_state[]) AND content_purged_at IS NULL
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::timestamptz IS NULL OR created_at < $3)
  AND ($4::bigint IS NULL OR run_id = $4)
  AND ($5::text IS NULL OR reminder_id = $5)
  AND ($6::text IS NULL OR provider = $6)
  AND ($7::text IS NULL OR channel = $7)
  AND ($8::text IS NULL OR idempotency_key = $8)
  AND ($9::int IS NULL OR last_status = $9)
  AND id > $10
ORDER BY id
LIMIT $11;

-- name: reset_for_replay
-- dead -> pending for another round of attempts; the attempt history stays, and the new
-- round's budget counts from here (round_start). Any other state is left alone, and so
-- is a row whose recipient was erased (`relay erase`: nothing to send it to) or whose
-- content retention purged (`relay purge`: nothing to send). Locked in id order, like
-- every statement that locks several deliveries.
WITH locked AS (
    SELECT id FROM deliveries
    WHERE id = ANY($1::bigint[]) AND state = 'dead' AND erased_at IS NULL
      AND content_purged_at IS NULL
    ORDER BY id
    FOR UPDATE
)
UPDATE deliveries AS d SET state = 'pending', round_start = d.attempts, replays = d.replays + 1,
                           finished_at = NULL, dead_lettered_at = NULL
FROM locked
WHERE d.id = locked.id AND d.state = 'dead'
RETURNING d.id, d.urgent;

-- name: replay_started
-- An applied replay's (or drop's) session locks its row's id, in the statement that makes
-- the row visible, as start_run does: a row not finished whose lock no session holds is a
-- replay that ended without recording its end (console_replays_recent says so).
WITH started AS (
    INSERT INTO replays (source, operator, filters) VALUES ($1, $2, $3) RETURNING id
)
SELECT id, pg_advisory_lock(72177029, (id % 2147483647)::int) FROM started;

-- name: replay_progress
-- What a replay (or drop) has done so far, recorded as it goes: a replay that is killed
-- leaves the counts of its last page, not zeros.
UPDATE replays SET selected = $2, replayed = $3, dropped = $4
WHERE id = $1 AND finished_at IS NULL;

-- name: replay_finished
UPDATE replays SET selected = $2, replayed = $3, interrupted = $4, finished_at = now()
WHERE id = $1;

-- name: delivery_lane
SELECT id, state::text AS state, urgent FROM deliveries WHERE id = $1;

---------------------------------------------------------------------------- budgets

-- name: configure_budget
-- Each consumer writes the configured budget at start-up (same settings everywhere).
INSERT INTO rate_budgets (provider, rate_per_second, burst, tokens)
VALUES ($1, $2, $3, $3)
ON CONFLICT (provider) DO UPDATE SET
    rate_per_second = excluded.rate_per_second, burst = excluded.burst, updated_at = now();

-- name: ensure_budget
-- A provider without a configured budget still gets a row, so a throttle can pause it.
INSERT INTO rate_budgets (provider) VALUES ($1) ON CONFLICT (provider) DO NOTHING;

-- name: lease_tokens
-- Take up to $2 tokens from the provider's bucket (refilled at its rate, holding at most
-- $4 tokens, or its burst when $4 is NULL), leaving $3 tokens in it (the reserve kept for
-- the urgent lane). No rate means no budget: only a throttle pause stops it. One row
-- lock, held for one statement. The grant's time is read once and is never earlier than
-- the last grant's (greatest with refilled_at), so grant times follow the lock order and
-- a bucket of capacity c grants at most floor(c + rate * L) tokens in any L seconds
-- (consumer/budget.py).
WITH b AS (
    SELECT provider, rate_per_second AS rate, paused_until, tokens, refilled_at,
           coalesce($4::float8, burst) AS capacity,
           greatest(clock_timestamp(), refilled_at) AS granted_at
    FROM rate_budgets WHERE provider = $1
    FOR UPDATE
), a AS (
    SELECT b.*,
           CASE WHEN rate IS NULL THEN $2::float8
                ELSE least(capacity, tokens + rate * extract(epoch FROM granted_at - refilled_at))
           END AS available
    FROM b
), g AS (
    SELECT a.*,
           CASE WHEN paused_until > granted_at THEN 0
                ELSE greatest(0, floor(least($2::float8, available - $3::float8))) END AS granted
    FROM a
)
UPDATE rate_budgets AS r SET
    tokens = CASE WHEN g.rate IS NULL THEN 0 ELSE g.available - g.granted END,
    refilled_at = g.granted_at
FROM g
WHERE r.provider = g.provider
RETURNING g.granted::int AS granted, g.available, g.rate,
          greatest(0, extract(epoch FROM g.paused_until - g.granted_at))::float8
              AS paused_seconds,
          g.granted_at;

-- name: pause_budget
-- A throttle answer: nobody sends to this provider until then. The bucket is emptied;
-- its clock, like every grant's, never goes backwards.
UPDATE rate_budgets SET
    paused_until = greatest(coalesce(paused_until, clock_timestamp()),
                            clock_timestamp() + make_interval(secs => $2)),
    tokens = 0, refilled_at = greatest(refilled_at, clock_timestamp()), updated_at = now()
WHERE provider = $1;

---------------------------------------------------------------------------- destinations

-- name: destination_disable
-- Disable a destination (registered now if it was not): its deliveries are held and its
-- active webhook reminders paused with the reason $3 ('destination_disabled', or 'gone'
-- after a 410), so that enable can tell them from the ones an operator cancelled. Returns
-- its id when this statement disabled it (NULL when it already was) and how many
-- reminders it paused.
WITH changed AS (
    INSERT INTO destinations AS d (url, state, disabled_reason, disabled_at)
    VALUES ($1, 'disabled', $2, now())
    ON CONFLICT (url) DO UPDATE SET
        state = 'disabled', disabled_reason = excluded.disabled_reason, disabled_at = now(),
        updated_at = now()
    WHERE d.state = 'enabled'
    RETURNING id
), paused AS (
    -- Reading `changed` first takes the destination's row lock before any reminder's, the
    -- order enable locks them in (sibling CTEs otherwise run in no set order).
    UPDATE reminders SET active = false, inactive_reason = $3, updated_at = now()
    WHERE destination = $1 AND channel = 'webhook' AND active
      AND (SELECT count(*) FROM changed) >= 0
    RETURNING id
)
SELECT (SELECT id FROM changed) AS id, (SELECT count(*) FROM paused)::int AS paused;

-- name: destination_lock_state
SELECT state FROM destinations WHERE url = $1 FOR UPDATE;

-- name: enable_destination
UPDATE destinations SET
    state = 'enabled', disabled_reason = NULL, disabled_at = NULL, failure_streak = 0,
    streak_started_at = NULL, updated_at = now()
WHERE url = $1 AND state = 'disabled'
RETURNING url;

-- name: enable_resume_reminders
-- Enable ($2 true) or its dry run ($2 false): the destination's reminders its disable (or
-- its 410) paused, with what planning their owed occurrences needs; resumed when $2. Their
-- next_due_at is left as it was: the next publish run judges what fell due meanwhile by
-- each one's missed-fire policy. A reminder an operator cancelled is never among them.
WITH paused AS (
    SELECT id, schedule_kind, due_at, daily_at, cron, timezone, missed_policy, next_due_at,
           stale_after, send_stale
    FROM reminders
    WHERE destination = $1 AND channel = 'webhook'
      AND inactive_reason IN ('destination_disabled', 'gone')
    ORDER BY id
    FOR UPDATE
), resumed AS (
    UPDATE reminders AS r SET active = true, inactive_reason = NULL, updated_at = now()
    FROM paused AS p
    WHERE $2 AND r.id = p.id
)
SELECT id, schedule_kind, due_at, daily_at, cron, timezone, missed_policy, next_due_at,
       extract(epoch FROM stale_after)::float8 AS stale_after_seconds, send_stale
FROM paused
ORDER BY id;

-- name: destination_cancelled_reminders
SELECT count(*)::int FROM reminders
WHERE destination = $1 AND channel = 'webhook' AND inactive_reason = 'cancelled';

-- name: enable_settle_held
-- Enable ($2 true) or its dry run ($2 false): the destination's deliveries not final and
-- not in flight, each with its fate: 'cancelled' (its reminder was cancelled or is gone),
-- 'stale' (older than its reminder's stale_after, without send_stale) or 'send'. When $2
-- the first two are skipped with that reason, and the held ones to send are due now
-- (their parked messages claim them when they come back). Counts by fate.
WITH held AS (
    SELECT d.id,
           CASE WHEN d.source = 'schedule'
                     AND (r.id IS NULL OR r.inactive_reason = 'cancelled') THEN 'cancelled'
                WHEN r.stale_after IS NOT NULL AND NOT r.send_stale
                     AND now() - d.occurrence_at > r.stale_after THEN 'stale'
                ELSE 'send' END AS fate
    FROM deliveries AS d
    LEFT JOIN reminders AS r ON r.id = d.reminder_id
    WHERE d.state IN ('pending', 'queued', 'retrying') AND d.channel = 'webhook'
      AND coalesce(d.destination, r.destination) = $1
    ORDER BY d.id
    FOR UPDATE OF d
), skipped AS (
    UPDATE deliveries AS d SET state = 'skipped', skip_reason = h.fate, finished_at = now(),
                               next_attempt_at = NULL
    FROM held AS h
    WHERE $2 AND d.id = h.id AND h.fate <> 'send'
      AND d.state IN ('pending', 'queued', 'retrying')
), woken AS (
    UPDATE deliveries AS d SET next_attempt_at = now()
    FROM held AS h
    WHERE $2 AND d.id = h.id AND h.fate = 'send'
      AND d.state = 'retrying' AND d.next_attempt_at > now()
)
SELECT count(*) FILTER (WHERE fate = 'send')::int AS send,
       count(*) FILTER (WHERE fate = 'stale')::int AS stale,
       count(*) FILTER (WHERE fate = 'cancelled')::int AS cancelled
FROM held;

-- name: destination_action_record
INSERT INTO destination_actions (url, action, operator, reason, effect)
VALUES ($1, $2, $3, $4, $5);

-- name: destination_actions_of
-- The latest operator actions on a destination, newest first.
SELECT action, operator, reason, effect, at
FROM destination_actions WHERE url = $1 ORDER BY id DESC LIMIT $2;

-- name: destinations_known
SELECT url FROM destinations WHERE url = ANY($1::text[]);

-- name: destinations_register
-- First use (or `relay destinations add`): register what is not registered yet.
INSERT INTO destinations (url, envelope)
SELECT u, $2 FROM unnest($1::text[]) AS u
ON CONFLICT (url) DO NOTHING
RETURNING url;

-- name: destination_add_secrets
INSERT INTO destination_secrets (url, encrypted)
SELECT * FROM unnest($1::text[], $2::text[]);

-- name: destination_lock
SELECT url FROM destinations WHERE url = $1 FOR UPDATE;

-- name: destination_has_secrets
SELECT EXISTS (SELECT 1 FROM destination_secrets WHERE url = $1);

-- name: destination_expire_secrets
-- A rotation: every secret still valid now stays valid for the grace ($2 s), no longer.
UPDATE destination_secrets SET expires_at = now() + make_interval(secs => $2)
WHERE url = $1 AND (expires_at IS NULL OR expires_at > now() + make_interval(secs => $2));

-- name: destination_get
SELECT d.id, d.url, d.state, d.disabled_reason, d.disabled_at, d.failure_streak,
       d.streak_started_at, d.envelope, d.created_at,
       (SELECT count(*) FROM destination_secrets AS s
        WHERE s.url = d.url AND (s.expires_at IS NULL OR s.expires_at > now()))::int
           AS active_secrets
FROM destinations AS d
WHERE ($1::text IS NULL OR d.url = $1)
ORDER BY d.id;

-- name: destination_secrets_of
-- Newest first; valid: not expired yet.
SELECT id, encrypted, created_at, expires_at,
       (expires_at IS NULL OR expires_at > now()) AS valid
FROM destination_secrets WHERE url = $1 ORDER BY id DESC;

-- name: destination_secrets_all
SELECT id, encrypted FROM destination_secrets ORDER BY id FOR UPDATE;

-- name: destination_secrets_reencrypt
UPDATE destination_secrets AS s SET encrypted = t.encrypted
FROM unnest($1::bigint[], $2::text[]) AS t(id, encrypted)
WHERE s.id = t.id;

-- name: destination_set_envelope
UPDATE destinations SET envelope = $2, updated_at = now() WHERE url = $1 RETURNING url;

-- name: destination_failed
-- One more failed attempt in the destination's streak. The streak disables an enabled
-- destination once it holds $2 attempts (0: never) spanning at least $3 seconds, and then
-- pauses its reminders, as every disable does. Returns the id, the streak and whether this
-- very statement disabled it.
WITH cur AS (
    SELECT url, state, failure_streak + 1 AS streak,
           coalesce(streak_started_at, now()) AS since
    FROM destinations WHERE url = $1
    FOR UPDATE
), t AS (
    SELECT cur.*, (state = 'enabled' AND $2::int > 0 AND streak >= $2::int
                   AND now() - since >= make_interval(secs => $3::float8)) AS trip
    FROM cur
), paused AS (
    -- the streak disabled it: its reminders are paused, as by any disable
    UPDATE reminders SET active = false, inactive_reason = 'destination_disabled',
                         updated_at = now()
    WHERE destination = $1 AND channel = 'webhook' AND active
      AND EXISTS (SELECT 1 FROM t WHERE t.trip)
)
UPDATE destinations AS d SET
    failure_streak = t.streak,
    streak_started_at = t.since,
    state = CASE WHEN t.trip THEN 'disabled' ELSE d.state END,
    disabled_reason = CASE WHEN t.trip THEN $4::text ELSE d.disabled_reason END,
    disabled_at = CASE WHEN t.trip THEN now() ELSE d.disabled_at END,
    updated_at = now()
FROM t
WHERE d.url = t.url
RETURNING d.id, t.streak, t.trip AS disabled;

-- name: destination_state_counts
SELECT state, count(*)::int AS n FROM destinations GROUP BY state;

-- name: destination_succeeded
UPDATE destinations SET failure_streak = 0, streak_started_at = NULL, updated_at = now()
WHERE url = $1 AND failure_streak > 0;

---------------------------------------------------------------------------- console
-- The operator console (service/ops/console) reads through these blocks; its actions go
-- through the same ledger functions as the CLI. A destination is named in URLs only by
-- its reference (the first 16 hex digits of its keyed HMAC-SHA256, refs.py), never by the
-- address itself.

-- name: console_run_missing
-- Who did not get it: one page of a run's deliveries not delivered, filtered by state,
-- channel and destination reference (NULL = any), after id $5. The reference is the
-- HMAC-SHA256 of the destination keyed by the deployment's key, its ipad and opad rounds
-- in $7 and $8 (service/ops/console/refs.py).
SELECT d.id, d.reminder_id, d.channel, d.state::text AS state, d.last_status, d.last_error,
       d.next_attempt_at, d.skip_reason, d.attempts, d.occurrence_at,
       coalesce(d.destination, r.destination) AS destination,
       left(encode(sha256($8::bytea || sha256($7::bytea || convert_to(
           coalesce(d.destination, r.destination, ''), 'UTF8'))), 'hex'), 16) AS destination_ref
FROM deliveries AS d
LEFT JOIN reminders AS r ON r.id = d.reminder_id
WHERE d.run_id = $1 AND d.state <> 'delivered'
  AND ($2::text IS NULL OR d.state::text = $2)
  AND ($3::text IS NULL OR d.channel = $3)
  AND ($4::text IS NULL OR left(encode(sha256($8::bytea || sha256($7::bytea || convert_to(
          coalesce(d.destination, r.destination, ''), 'UTF8'))), 'hex'), 16) = $4)
  AND d.id > $5
ORDER BY d.id
LIMIT $6;

-- name: console_delivery
-- One delivery as the console shows it: everything but the payload (the reference keyed
-- as in console_run_missing, the key's rounds in $2 and $3).
SELECT d.id, d.idempotency_key, d.reminder_id, d.source, d.channel, d.provider,
       coalesce(d.destination, r.destination) AS destination,
       left(encode(sha256($3::bytea || sha256($2::bytea || convert_to(
           coalesce(d.destination, r.destination, ''), 'UTF8'))), 'hex'), 16) AS destination_ref,
       d.occurrence_at, d.urgent, d.state::text AS state, d.attempts, d.round_start, d.replays,
       d.next_attempt_at, d.last_status, d.last_error, d.skip_reason, d.run_id, d.created_at,
       d.published_at, d.first_attempt_at, d.finished_at, d.dead_lettered_at, d.event_id,
       d.content_purged_at
FROM deliveries AS d
LEFT JOIN reminders AS r ON r.id = d.reminder_id
WHERE d.id = $1;

-- name: console_attempts
SELECT attempt, outcome, http_status, latency_ms, error, response_excerpt, started_at,
       finished_at, stale, possibly_delivered
FROM delivery_attempts
WHERE delivery_id = $1
ORDER BY attempt;

-- name: console_dead
-- The dead deliveries (what a ledger replay selects by default), newest first, filtered by
-- run and channel (NULL = any), before id $3 (NULL: from the newest).
SELECT d.id, d.reminder_id, d.channel, d.run_id, d.attempts, d.replays, d.last_status,
       d.last_error, d.finished_at, d.dead_lettered_at
FROM deliveries AS d
WHERE d.state = 'dead'
  AND ($1::bigint IS NULL OR d.run_id = $1)
  AND ($2::text IS NULL OR d.channel = $2)
  AND ($3::bigint IS NULL OR d.id < $3)
ORDER BY d.id DESC
LIMIT $4;

-- name: console_dead_count
SELECT count(*) FROM deliveries WHERE state = 'dead';

-- name: console_replays_recent
-- killed: not finished, and no session holds its lock (replay_started): its process is
-- gone, and its counts are those it last recorded (replay_progress).
SELECT r.id, r.source, r.operator, r.filters, r.selected, r.replayed, r.dropped,
       r.started_at, r.finished_at, r.interrupted,
       r.finished_at IS NULL AND NOT EXISTS (
           SELECT 1 FROM pg_locks AS l
           WHERE l.locktype = 'advisory' AND l.database = (
                     SELECT oid FROM pg_database WHERE datname = current_database())
             AND l.classid = 72177029 AND l.objid = (r.id % 2147483647)::oid
             AND l.objsubid = 2 AND l.granted) AS killed
FROM replays AS r
ORDER BY r.id DESC
LIMIT $1;

-- name: console_destinations
-- Every destination a reminder names or that is disabled: its reminders (active, paused by
-- a disable or a 410, cancelled), whether it is disabled (why, since when), its reference
-- (keyed as in console_run_missing, the key's rounds in $3 and $4).
SELECT coalesce(r.destination, dd.destination) AS destination,
       left(encode(sha256($4::bytea || sha256($3::bytea || convert_to(
           coalesce(r.destination, dd.destination), 'UTF8'))), 'hex'), 16) AS destination_ref,
       r.channel, coalesce(r.reminders, 0) AS reminders, coalesce(r.active, 0) AS active,
       coalesce(r.paused, 0) AS paused, coalesce(r.cancelled, 0) AS cancelled,
       dd.reason, dd.disabled_at
FROM (SELECT destination, min(channel) AS channel, count(*) AS reminders,
             count(*) FILTER (WHERE active) AS active,
             count(*) FILTER (WHERE inactive_reason IN ('destination_disabled', 'gone'))
                 AS paused,
             count(*) FILTER (WHERE inactive_reason = 'cancelled') AS cancelled
      FROM reminders GROUP BY destination) AS r
FULL JOIN disabled_destinations AS dd ON dd.destination = r.destination
WHERE ($1::text IS NULL OR left(encode(sha256($4::bytea || sha256($3::bytea || convert_to(
          coalesce(r.destination, dd.destination), 'UTF8'))), 'hex'), 16) = $1)
ORDER BY dd.disabled_at IS NULL, 1
LIMIT $2;

-- name: console_session_open
-- A new console session: the hash of its cookie's id, who, with which operators-file line,
-- its CSRF token, opened at $5, ending at $6 at the latest.
INSERT INTO console_sessions (id_hash, operator, credential, csrf, created_at, last_seen_at,
                              expires_at)
VALUES ($1, $2, $3, $4, $5, $5, $6);

-- name: console_session_touch
-- The session of a cookie, if it is live at $2 (not revoked, not past its absolute end, used
-- within the idle limit $3), its use recorded. No row: no session.
UPDATE console_sessions
SET last_seen_at = greatest(last_seen_at, $2)
WHERE id_hash = $1 AND revoked_at IS NULL AND expires_at > $2 AND last_seen_at > $2 - $3::interval
RETURNING id, operator, credential, csrf;

-- name: console_session_revoke
-- End a session now ($3: logout or operator_gone); NULL when it was not live.
UPDATE console_sessions
SET revoked_at = $2, revoked_why = $3
WHERE id_hash = $1 AND revoked_at IS NULL
RETURNING id;

-- name: console_sessions_prune
-- Sessions that ended before $1 (kept a while for the record) go.
DELETE FROM console_sessions WHERE expires_at < $1;

-- name: console_reveal_record
INSERT INTO console_reveals (operator, page, at) VALUES ($1, $2, $3) RETURNING id;

-- name: console_secret_make
-- The deployment's secret named $1, made once: the first console to start wins.
INSERT INTO console_secrets (name, secret) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING;

-- name: console_secret
SELECT secret FROM console_secrets WHERE name = $1;

---------------------------------------------------------------------------- operators

-- name: delivery_show
-- One delivery's story: the row, its run, and its reminder's description (never the
-- reminder's destination or payload). By id ($1) or by idempotency key ($2).
SELECT d.id, d.idempotency_key, d.reminder_id, d.source, d.channel, d.provider,
       d.occurrence_at, d.urgent, d.state::text AS state, d.attempts, d.round_start, d.replays,
       d.next_attempt_at, d.lease_expires_at, d.last_status, d.last_error, d.receipt,
       d.skip_reason, d.run_id, d.created_at, d.published_at, d.first_attempt_at,
       d.finished_at, d.dead_lettered_at, d.settled_at, d.rescued_at, d.republished_at,
       d.republishes,
       coalesce(d.destination, r.destination) AS destination,
       r.schedule_kind, r.daily_at, r.cron, r.due_at, r.timezone, r.missed_policy,
       r.active AS reminder_active, r.next_due_at AS reminder_next_due_at,
       p.kind AS run_kind, p.status AS run_status, p.held_at AS run_held_at, d.event_id,
       d.content_purged_at, d.erased_at
FROM deliveries AS d
LEFT JOIN reminders AS r ON r.id = d.reminder_id
LEFT JOIN publish_runs AS p ON p.id = d.run_id
WHERE ($1::bigint IS NOT NULL AND d.id = $1) OR ($2::text IS NOT NULL AND d.idempotency_key = $2);

-- name: delivery_attempts_of
SELECT attempt, outcome, http_status, latency_ms, error, response_excerpt, started_at,
       finished_at, stale, possibly_delivered, provider_message_id
FROM delivery_attempts WHERE delivery_id = $1 ORDER BY attempt;

-- name: deliveries_list
-- One page of deliveries by the operator's filters (NULL = any), newest first; keyset
-- paging with $9 (the last id of the previous page).
SELECT d.id, d.idempotency_key, d.reminder_id, d.source, d.channel, d.state::text AS state,
       d.attempts, d.last_status, d.last_error, d.skip_reason, d.run_id, d.occurrence_at,
       d.created_at, d.finished_at, d.content_purged_at
FROM deliveries AS d
LEFT JOIN reminders AS r ON r.id = d.reminder_id
WHERE ($1::text[] IS NULL OR d.state::text = ANY($1::text[]))
  AND ($2::bigint IS NULL OR d.run_id = $2)
  AND ($3::text IS NULL OR d.reminder_id = $3)
  AND ($4::text IS NULL OR coalesce(d.destination, r.destination) = $4)
  AND ($5::text IS NULL OR d.channel = $5)
  AND ($6::timestamptz IS NULL OR d.occurrence_at >= $6)
  AND ($7::timestamptz IS NULL OR d.occurrence_at < $7)
  AND ($9::bigint IS NULL OR d.id < $9)
ORDER BY d.id DESC
LIMIT $8;

-- name: runs_list
-- Recent runs with their deliveries' states, newest first; keyset paging with $2. The
-- page of runs is chosen first, then each one's rows are counted (deliveries_run_idx).
WITH recent AS (
    SELECT id, kind, status, intended_fire_at, started_at, finished_at, held_at, created_count
    FROM publish_runs
    WHERE ($2::bigint IS NULL OR id < $2) AND (NOT $3::bool OR created_count > 0)
    ORDER BY id DESC
    LIMIT $1
)
SELECT r.id, r.kind, r.status, r.intended_fire_at, r.started_at, r.finished_at, r.held_at,
       r.created_count, c.owed + p.owed AS owed, c.delivered + p.delivered AS delivered,
       c.skipped + p.skipped AS skipped, c.dead + p.dead AS dead, c.open, p.owed AS purged
FROM recent AS r
CROSS JOIN LATERAL (
    SELECT count(*) AS owed,
           count(*) FILTER (WHERE d.state = 'delivered') AS delivered,
           count(*) FILTER (WHERE d.state = 'skipped') AS skipped,
           count(*) FILTER (WHERE d.state = 'dead') AS dead,
           count(*) FILTER (WHERE d.state IN ('pending', 'queued', 'sending', 'retrying'))
               AS open
    FROM deliveries AS d WHERE d.run_id = r.id
) AS c
-- Rows retention purged: counted from the run's record ('channel/state/reason' -> rows).
CROSS JOIN LATERAL (
    SELECT coalesce(sum(n.value::int), 0) AS owed,
           coalesce(sum(n.value::int) FILTER (WHERE split_part(n.key, '/', 2) = 'delivered'), 0)
               AS delivered,
           coalesce(sum(n.value::int) FILTER (WHERE split_part(n.key, '/', 2) = 'skipped'), 0)
               AS skipped,
           coalesce(sum(n.value::int) FILTER (WHERE split_part(n.key, '/', 2) = 'dead'), 0)
               AS dead
    FROM publish_runs AS pr, jsonb_each_text(pr.purged_counts) AS n
    WHERE pr.id = r.id
) AS p
ORDER BY r.id DESC;

-- name: run_exists
SELECT id, held_at FROM publish_runs WHERE id = $1;

-- name: run_hold
UPDATE publish_runs SET held_at = now() WHERE id = $1 AND held_at IS NULL RETURNING id;

-- name: run_release
UPDATE publish_runs SET held_at = NULL WHERE id = $1 AND held_at IS NOT NULL RETURNING id;

-- name: run_open_counts
-- A run's rows an operator's action would reach: not claimed (movable); claimed, not past
-- their last check (claimed: a cancel stops them before their request); past it
-- (on_the_wire: their request may be on its way).
SELECT count(*) FILTER (WHERE state IN ('pending', 'queued', 'retrying')) AS movable,
       count(*) FILTER (WHERE state = 'sending' AND last_check_at IS NULL) AS claimed,
       count(*) FILTER (WHERE state = 'sending' AND last_check_at IS NOT NULL) AS on_the_wire
FROM deliveries WHERE run_id = $1;

-- name: run_stop
-- Cancel ($2 'cancel': skipped, reason cancelled) or dead-letter ($2 'dead-letter': dead,
-- replayable; $4 its last_error) run $1, for the recorded action $3. Rows not claimed, and
-- claimed rows not past their last check, move at once: the consumer holding one finds it
-- moved at its last check (which locks the row as this does) and sends nothing; the
-- claim's unused attempt is recorded 'skipped'. Rows past their last check may be on the
-- wire: they finish, marked with the action, and never pass another last check. One
-- statement, rows locked in id order. Returns each row moved or on the wire.
WITH locked AS (
    SELECT id, state, attempts, last_check_at, stop_action_id
    FROM deliveries
    WHERE run_id = $1 AND state IN ('pending', 'queued', 'sending', 'retrying')
    ORDER BY id
    FOR UPDATE
), moved AS (
    UPDATE deliveries AS d SET
        state = (CASE WHEN $2::text = 'cancel' THEN 'skipped' ELSE 'dead' END)::delivery_state,
        skip_reason = CASE WHEN $2::text = 'cancel' THEN 'cancelled' END,
        last_error = CASE WHEN $2::text = 'cancel' THEN d.last_error ELSE $4::text END,
        finished_at = now(), next_attempt_at = NULL, lease_expires_at = NULL,
        stop_action_id = NULL
    FROM locked AS l
    WHERE d.id = l.id AND (l.state <> 'sending' OR l.last_check_at IS NULL)
    RETURNING d.id, l.state AS prior_state, d.attempts
), marked AS (
    UPDATE deliveries AS d SET stop_action_id = $3
    FROM locked AS l
    WHERE d.id = l.id AND l.state = 'sending' AND l.last_check_at IS NOT NULL
      AND l.stop_action_id IS NULL
), unused AS (
    INSERT INTO delivery_attempts (delivery_id, attempt, outcome, error, possibly_delivered)
    SELECT id, attempts, 'skipped',
           CASE WHEN $2::text = 'cancel' THEN 'cancelled' ELSE $4::text END,
           false
    FROM moved WHERE prior_state = 'sending'
    ON CONFLICT DO NOTHING
)
SELECT id, prior_state::text AS prior_state, attempts, false AS on_the_wire FROM moved
UNION ALL
SELECT id, 'sending', attempts, true FROM locked
WHERE state = 'sending' AND last_check_at IS NOT NULL;

-- name: run_wire_states
-- The rows an action found on the wire: each one's state and attempt now.
SELECT id, state::text AS state, attempts FROM deliveries WHERE id = ANY($1::bigint[]);

-- name: run_release_parked
-- On release: rows parked while the run was held are due again now.
UPDATE deliveries SET next_attempt_at = now()
WHERE run_id = $1 AND state = 'retrying' AND next_attempt_at > now()
RETURNING id;

-- name: run_action_record
INSERT INTO run_actions (run_id, action, operator, reason, rows) VALUES ($1, $2, $3, $4, $5)
RETURNING id, at;

-- name: run_action_counts
-- What a cancel or dead-letter did (in its own transaction, after run_stop), and again
-- once it stopped waiting for the rows it found on the wire.
UPDATE run_actions SET rows = $2, claimed_stopped = $3, on_the_wire = $4, wire_outcomes = $5
WHERE id = $1;

-- name: run_actions_of
SELECT run_id, action, operator, reason, rows, claimed_stopped, on_the_wire, wire_outcomes, at
FROM run_actions
WHERE run_id = ANY($1::bigint[]) ORDER BY id;

-- name: admission_pause_open
INSERT INTO admission_pauses (paused_by) VALUES ($1) ON CONFLICT DO NOTHING;

-- name: admission_pause_close
UPDATE admission_pauses SET resumed_at = now(), resumed_by = $1 WHERE resumed_at IS NULL;

-- name: admission_pause_windows
-- Windows that cover anything at or after $1 (an open one reaches until now).
SELECT paused_at, coalesce(resumed_at, 'infinity'::timestamptz) AS resumed_at
FROM admission_pauses
WHERE coalesce(resumed_at, 'infinity'::timestamptz) > $1
ORDER BY paused_at;

-- name: backfill_reminders
-- Never an erased reminder (`relay erase`): its recipient is gone.
SELECT id, channel, provider, urgent, schedule_kind, due_at, daily_at, cron, timezone,
       missed_policy, next_due_at, active
FROM reminders
WHERE (($1::text IS NULL AND active) OR id = $1)
  AND inactive_reason IS DISTINCT FROM 'erased'
ORDER BY id;

-- name: deliveries_by_keys
SELECT idempotency_key, state::text AS state, skip_reason FROM deliveries
WHERE idempotency_key = ANY($1::text[]);

-- name: skip_rescheduled
-- An edit of a schedule, in its transaction: admitted rows the new schedule no longer owes
-- -> skipped (rescheduled). A row claimed meanwhile is in flight and left alone (the guard).
-- Locked in id order.
WITH locked AS (
    SELECT id FROM deliveries
    WHERE id = ANY($1::bigint[]) AND state IN ('pending', 'queued', 'retrying')
    ORDER BY id
    FOR UPDATE
)
UPDATE deliveries AS d SET state = 'skipped', skip_reason = 'rescheduled', finished_at = now(),
                           next_attempt_at = NULL
FROM locked
WHERE d.id = locked.id AND d.state IN ('pending', 'queued', 'retrying')
RETURNING d.id;

-- name: reopen_paused
-- Backfill: occurrences skipped because admission was paused are owed again, on purpose,
-- as rows of the backfill run. Any other row is left as it is (an erased one too).
WITH locked AS (
    SELECT id FROM deliveries
    WHERE idempotency_key = ANY($1::text[]) AND state = 'skipped' AND skip_reason = 'paused'
      AND erased_at IS NULL
    ORDER BY id
    FOR UPDATE
)
UPDATE deliveries AS d SET state = 'pending', skip_reason = NULL, finished_at = NULL,
                           run_id = $2,
                           -- a paused skip never had content of its own to purge
                           content_purged_at = NULL
FROM locked
WHERE d.id = locked.id AND d.state = 'skipped'
RETURNING d.id, d.urgent, d.state, d.occurrence_at;

-- name: outbox_missing
-- Outbox intents not delivered (they belong to no run), newest first.
SELECT d.id, d.reminder_id, d.idempotency_key, d.channel, d.state::text AS state,
       d.last_status, d.last_error, d.next_attempt_at, d.skip_reason, d.attempts,
       d.occurrence_at,
       CASE WHEN d.state = 'accepted' THEN extract(epoch FROM now() - d.finished_at)::float8
            END AS accepted_seconds,
       d.content_purged_at
FROM deliveries AS d
WHERE d.source = 'outbox' AND d.state <> 'delivered' AND d.event_id IS NULL
ORDER BY d.id DESC
LIMIT $1;

-- name: run_channel_counts
SELECT run_id, channel, state::text AS state, count(*) AS n
FROM deliveries
WHERE run_id = ANY($1::bigint[])
GROUP BY run_id, channel, state;

-- name: replay_dropped
UPDATE replays SET selected = $2, dropped = $3, interrupted = $4, finished_at = now()
WHERE id = $1;

-- name: admission_state
SELECT paused, changed_at, changed_by FROM admission;

-- name: run_published_count
-- A backfill that published at once: its run's confirmed and failed publishes.
UPDATE publish_runs SET published_count = $2, failed_count = $3,
                        status = CASE WHEN $3 > 0 THEN 'incomplete' ELSE status END
WHERE id = $1;

-- name: delivery_for_drop
-- What `relay replay --drop` matches a dead letter's delivery against.
SELECT id, state::text AS state, created_at, run_id, reminder_id, provider, channel,
       idempotency_key AS key, last_status
FROM deliveries WHERE id = $1;

---------------------------------------------------------------------------- receipts

-- name: receipt_delivery
-- The delivery a provider's receipt is about: the one whose attempt sent that message, else
-- the one the message named (the e-mail's tag, the SMS callback's query), of its channel.
SELECT d.id FROM deliveries AS d
WHERE d.channel = $1
  AND d.id = coalesce((SELECT a.delivery_id FROM delivery_attempts AS a
                       WHERE a.provider_message_id = $2
                       ORDER BY a.delivery_id DESC LIMIT 1), $3);

-- name: receipt_lock
-- Before a receipt is recorded: the delivery's row lock, which the consumer's outcome write
-- also takes. Whichever commits second sees the other's write and settles the row, so a
-- receipt that came before the outcome is never left unread.
SELECT state::text AS state FROM deliveries WHERE id = $1 FOR UPDATE;

-- name: receipt_insert
-- Append one receipt; the same callback again (same event key) adds nothing.
INSERT INTO receipts (delivery_id, channel, provider_message_id, event_key, event, outcome,
                      permanent, reason, provider_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (channel, event_key) DO NOTHING
RETURNING id;

-- name: receipts_settle
-- Settle deliveries by every receipt the ledger holds for them: the strongest wins
-- (bounced over delivered or complained; a sent or delayed one settles nothing), so
-- receipts in any order, or twice, end in the same state. accepted -> delivered | bounced,
-- and delivered -> bounced (a bounce after the receiving server took it); never back.
-- Webhook rows (their 2xx is the receiver's word) and open rows are left alone. Locked in
-- id order, like every statement that locks several deliveries.
WITH best AS (
    SELECT DISTINCT ON (r.delivery_id) r.delivery_id AS id, r.outcome, r.event, r.reason
    FROM receipts AS r
    WHERE r.delivery_id = ANY($1::bigint[])
      AND r.outcome IN ('delivered', 'complained', 'bounced')
    ORDER BY r.delivery_id, (r.outcome = 'bounced') DESC, r.id DESC
), target AS (
    SELECT d.id,
           (CASE WHEN b.outcome = 'bounced' THEN 'bounced' ELSE 'delivered' END)::delivery_state
               AS state,
           left('bounced: ' || coalesce(b.reason, b.event), 500) AS bounce_error
    FROM deliveries AS d JOIN best AS b ON b.id = d.id
    WHERE d.channel IN ('email', 'sms')
      AND (d.state = 'accepted' OR (d.state = 'delivered' AND b.outcome = 'bounced'))
    ORDER BY d.id
    FOR UPDATE OF d
)
UPDATE deliveries AS d SET
    state = t.state,
    settled_at = now(),
    last_error = CASE WHEN t.state = 'bounced' THEN t.bounce_error ELSE d.last_error END
FROM target AS t
WHERE d.id = t.id
  AND (d.state = 'accepted' OR (d.state = 'delivered' AND t.state = 'bounced'))
RETURNING d.id, d.state::text AS state;

-- name: receipts_of
-- One delivery's receipts, in the order they came (`relay deliveries show`).
SELECT provider_message_id, event, outcome, permanent, reason, provider_at, received_at
FROM receipts WHERE delivery_id = $1 ORDER BY id;

-- name: run_receipt_overdue
-- Per run and channel: e-mail and SMS the provider accepted longer than $2 seconds ago
-- that no receipt has settled ("accepted, no receipt after N minutes").
SELECT run_id, channel, count(*) AS n
FROM deliveries
WHERE run_id = ANY($1::bigint[]) AND state = 'accepted'
  AND finished_at < now() - make_interval(secs => $2)
GROUP BY run_id, channel;

-- name: receipt_overdue_total
-- Every delivery (runs and outbox) accepted longer than $1 seconds ago without a receipt.
SELECT count(*) FROM deliveries
WHERE state = 'accepted' AND finished_at < now() - make_interval(secs => $1);

---------------------------------------------------------------------------- suppressions

-- name: suppression_from_receipt
-- A receipt that says the address will not take messages (a hard bounce, a complaint, a
-- permanent SMS error) suppresses the destination of its delivery, unless it already is
-- (or the delivery's recipient was erased: it has no destination any more).
INSERT INTO suppressions (channel, address, reason, detail, delivery_id, created_by)
SELECT d.channel, suppression_address(d.channel, coalesce(d.destination, r.destination)),
       $2, left($3, 500), d.id, 'relay receipts'
FROM deliveries AS d
LEFT JOIN reminders AS r ON r.id = d.reminder_id
WHERE d.id = $1 AND d.channel IN ('email', 'sms') AND d.erased_at IS NULL
  AND coalesce(d.destination, r.destination) IS NOT NULL
ON CONFLICT (channel, address) WHERE removed_at IS NULL DO NOTHING
RETURNING id;

-- name: suppression_add
-- An operator's suppression of an address; nothing when it is suppressed already.
INSERT INTO suppressions (channel, address, reason, detail, created_by)
VALUES ($1, suppression_address($1, $2), 'operator', left($3, 500), $4)
ON CONFLICT (channel, address) WHERE removed_at IS NULL DO NOTHING
RETURNING id, channel, address, reason, detail, delivery_id, created_by, created_at, removed_at,
          removed_by, removed_reason;

-- name: suppression_remove
-- An operator lifts a suppression: the row stays, marked with who, when and why.
UPDATE suppressions SET removed_at = now(), removed_by = $3, removed_reason = left($4, 500)
WHERE channel = $1 AND address = suppression_address($1, $2) AND removed_at IS NULL
RETURNING id, channel, address, reason, detail, delivery_id, created_by, created_at, removed_at,
          removed_by, removed_reason;

-- name: suppressions_list
-- The list, newest first: those in force, or ($2) every one ever made; channel $1 or any.
SELECT id, channel, address, reason, detail, delivery_id, created_by, created_at, removed_at,
       removed_by, removed_reason
FROM suppressions
WHERE ($1::text IS NULL OR channel = $1) AND ($2 OR removed_at IS NULL)
ORDER BY id DESC
LIMIT $3;

---------------------------------------------------------------------------- reconciliation

-- name: reconcile_candidates
-- The earlier attempts of a delivery whose request may have reached the provider without
-- its answer being read: lost (the consumer died), or failed after connecting with no
-- answer (a timeout, a reset), since the provider last gave an answer about this delivery.
SELECT a.attempt
FROM delivery_attempts AS a
WHERE a.delivery_id = $1 AND a.attempt < $2
  AND (a.outcome = 'lost'
       OR (a.outcome = 'retry' AND a.http_status IS NULL AND a.possibly_delivered))
  AND a.attempt >= coalesce((SELECT max(r.attempt) FROM reconciliations AS r
                             WHERE r.delivery_id = $1 AND r.answer <> 'unknown'), 0)
ORDER BY a.attempt;

-- name: reconciliation_record
INSERT INTO reconciliations (delivery_id, attempt, checked_attempts, answer, provider_message_id,
                             provider_status, policy, error)
VALUES ($1, $2, $3, $4, $5, left($6, 64), $7, left($8, 200))
RETURNING id;

-- name: reconciliations_of
-- One delivery's reconciliations, oldest first (`relay deliveries show`).
SELECT attempt, checked_attempts, answer, provider_message_id, provider_status, policy, error,
       asked_at
FROM reconciliations WHERE delivery_id = $1 ORDER BY id;

---------------------------------------------------------------------------- events
-- Event types, subscriptions and events (service/events.py, service/subscriptions.py). An
-- event's deliveries are outbox deliveries (source 'outbox') that name it (event_id).

-- name: event_type_upsert
-- Add a type, or change its description and schema; returns nothing when it is unchanged.
INSERT INTO event_types AS t (name, description, schema)
VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE SET
    description = excluded.description, schema = excluded.schema, updated_at = now()
WHERE t.description IS DISTINCT FROM excluded.description
   OR t.schema IS DISTINCT FROM excluded.schema
RETURNING (xmax = 0) AS added;

-- name: event_types_list
-- The catalogue ($1: one type, NULL: all), with the subscriptions that take each type.
SELECT t.name, t.description, t.schema, t.created_at, t.updated_at,
       (SELECT count(DISTINCT s.url) FROM event_subscriptions AS s
        WHERE event_pattern_matches(s.pattern, t.name))::int AS subscribers
FROM event_types AS t
WHERE $1::text IS NULL OR t.name = $1
ORDER BY t.name;

-- name: event_type_subscribers
-- Who receives a type: each destination with the subscriptions that take it.
SELECT d.id AS destination_id, d.url, d.state, s.pattern, s.filter, s.provider
FROM event_subscriptions AS s
JOIN destinations AS d ON d.url = s.url
WHERE event_pattern_matches(s.pattern, $1)
ORDER BY d.id, s.pattern;

-- name: event_type_schema
-- What recording an event of this type checks: whether the type exists, and its schema.
SELECT schema FROM event_types WHERE name = $1;

-- name: event_add
-- Record one event ($1 key, $2 type, $3 payload, $4 urgent) and, in the same statement, one
-- pending delivery per destination with a subscription that takes it (its pattern matches
-- the type and its filter the payload), keyed 'event:<key>:<destination id>'. A key
-- recorded before inserts nothing at all: an event is fanned out once, to the
-- subscriptions in force when it was first recorded. A disabled destination's delivery is
-- held like all of its deliveries. The budget is the one named by the most specific
-- matching subscription that names one (an exact name before the longest prefix).
WITH targets AS (
    SELECT d.id AS destination_id, d.url,
           (array_agg(s.provider ORDER BY s.pattern = $2 DESC, length(s.pattern) DESC)
                FILTER (WHERE s.provider IS NOT NULL))[1] AS provider
    FROM event_subscriptions AS s
    JOIN destinations AS d ON d.url = s.url
    WHERE event_pattern_matches(s.pattern, $2) AND event_filter_matches(s.filter, $3::jsonb)
    GROUP BY d.id, d.url
), event AS (
    INSERT INTO events (key, event_type, payload, urgent)
    VALUES ($1, $2, $3, $4)
    ON CONFLICT (key) DO NOTHING
    RETURNING id, created_at
), made AS (
    INSERT INTO deliveries (idempotency_key, source, channel, provider, destination, payload,
                            occurrence_at, urgent, event_type, event_id)
    SELECT 'event:' || $1 || ':' || t.destination_id, 'outbox', 'webhook',
           coalesce(t.provider, 'webhook'), t.url, $3, e.created_at, $4, $2, e.id
    FROM event AS e CROSS JOIN targets AS t
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id
)
SELECT (SELECT id FROM event) AS event_id, (SELECT count(*) FROM made)::int AS deliveries;

-- name: subscription_upsert
-- Subscribe a destination to a pattern (its filter and budget replaced if it was already).
INSERT INTO event_subscriptions AS s (url, pattern, filter, provider)
VALUES ($1, $2, $3, $4)
ON CONFLICT (url, pattern) DO UPDATE SET
    filter = excluded.filter, provider = excluded.provider, updated_at = now()
RETURNING s.id, (xmax = 0) AS added;

-- name: subscription_delete
DELETE FROM event_subscriptions WHERE url = $1 AND pattern = $2 RETURNING id;

-- name: subscriptions_of
-- A destination's subscriptions ($1 NULL: every destination's), by destination and pattern.
SELECT s.url, d.id AS destination_id, s.pattern, s.filter, s.provider, s.created_at
FROM event_subscriptions AS s
JOIN destinations AS d ON d.url = s.url
WHERE $1::text IS NULL OR s.url = $1
ORDER BY d.id, s.pattern;

-- name: subscription_backfill
-- On purpose only: owe the destination $1 the events its subscription $2 takes that were
-- recorded at or after $3 and before $4, as admission would have (same keys, so an event it
-- already has adds nothing). Returns the new rows for publishing.
INSERT INTO deliveries (idempotency_key, source, channel, provider, destination, payload,
                        occurrence_at, urgent, event_type, event_id)
SELECT 'event:' || e.key || ':' || d.id, 'outbox', 'webhook', coalesce(s.provider, 'webhook'),
       d.url, e.payload, e.created_at, e.urgent, e.event_type, e.id
FROM event_subscriptions AS s
JOIN destinations AS d ON d.url = s.url
JOIN events AS e ON event_pattern_matches(s.pattern, e.event_type)
WHERE s.url = $1 AND s.pattern = $2 AND e.created_at >= $3 AND e.created_at < $4
  AND e.content_purged_at IS NULL  -- refused before the retention horizon; never sent empty
  AND event_filter_matches(s.filter, e.payload)
ORDER BY e.id
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, urgent, occurrence_at;

-- name: event_get
-- One event by id ($1) or key ($2), without its payload.
SELECT e.id, e.key, e.event_type, e.urgent, e.created_at,
       (SELECT count(*) FROM deliveries AS d WHERE d.event_id = e.id)::int AS deliveries
FROM events AS e
WHERE ($1::bigint IS NOT NULL AND e.id = $1) OR ($2::text IS NOT NULL AND e.key = $2);

-- name: console_event_deliveries
-- An event's deliveries ($1), by destination: where each stands, for the console (the
-- reference keyed as in console_run_missing, the key's rounds in $2 and $3).
SELECT d.id, d.idempotency_key, d.channel, d.destination, dst.id AS destination_id,
       left(encode(sha256($3::bytea || sha256($2::bytea || convert_to(
           coalesce(d.destination, ''), 'UTF8'))), 'hex'), 16) AS destination_ref,
       coalesce(dst.state = 'disabled', false) AS destination_disabled,
       d.provider, d.state::text AS state, d.attempts, d.last_status, d.last_error,
       d.skip_reason, d.next_attempt_at, d.created_at, d.first_attempt_at, d.finished_at
FROM deliveries AS d
LEFT JOIN destinations AS dst ON dst.url = d.destination
WHERE d.event_id = $1
ORDER BY d.id;

-- name: events_recent
-- The latest events (newest first, before id $2; NULL: from the newest), $3 of type (NULL:
-- any), with how their deliveries stand.
SELECT e.id, e.key, e.event_type, e.created_at,
       count(d.id)::int AS deliveries,
       count(d.id) FILTER (WHERE d.state = 'delivered')::int AS delivered,
       count(d.id) FILTER (WHERE d.state = 'dead')::int AS dead
FROM events AS e
LEFT JOIN deliveries AS d ON d.event_id = e.id
WHERE ($2::bigint IS NULL OR e.id < $2) AND ($3::text IS NULL OR e.event_type = $3)
GROUP BY e.id
ORDER BY e.id DESC
LIMIT $1;

-- name: event_missing
-- Who did not get which event: event deliveries not delivered, newest event first (the
-- report groups them by event).
SELECT e.id AS event_id, e.key AS event_key, e.event_type, e.created_at AS event_at,
       d.id, d.idempotency_key, d.reminder_id, d.channel, d.destination,
       d.state::text AS state, d.last_status, d.last_error, d.next_attempt_at, d.skip_reason,
       d.attempts, d.occurrence_at, d.content_purged_at
FROM deliveries AS d
JOIN events AS e ON e.id = d.event_id
WHERE d.event_id IS NOT NULL AND d.state <> 'delivered'
ORDER BY d.event_id DESC, d.id
LIMIT $1;

---------------------------------------------------------------------------- retention
-- `relay purge` (service/purge.py). Each step picks candidates without a lock (the same
-- pick counts a dry run), then changes them in one short transaction that locks them
-- (SKIP LOCKED: a row someone holds is left for the next run) and checks again what the
-- pick checked: a guarded statement, like every transition. A cutoff that is NULL means
-- "never": a comparison with it is never true.

-- name: purge_lock
-- One purge at a time (a session lock: a killed purge's ends with its connection).
SELECT pg_try_advisory_lock(72177027);

-- name: purge_unlock
SELECT pg_advisory_unlock(72177027);

-- name: purge_due_work
-- Deliveries due and not settled (a 06:00 wave, a backlog, retries due): the purge waits
-- for them between batches. Each branch reads a partial index and stops at its first row.
SELECT EXISTS (SELECT 1 FROM deliveries WHERE state = 'queued' AND occurrence_at <= now())
    OR EXISTS (SELECT 1 FROM deliveries WHERE state = 'pending' AND occurrence_at <= now())
    OR EXISTS (SELECT 1 FROM deliveries WHERE state = 'sending')
    OR EXISTS (SELECT 1 FROM deliveries WHERE state = 'retrying' AND next_attempt_at <= now());

-- name: purge_runs_interrupted
-- Runs still 'running' when a purge holds the lock were killed before they finished.
UPDATE purge_runs SET status = 'interrupted', finished_at = now(),
                      error = 'ended before it finished (killed, or its database went away)'
WHERE status = 'running';

-- name: purge_run_start
INSERT INTO purge_runs (as_of, policy, host) VALUES ($1, $2, $3) RETURNING id;

-- name: purge_run_progress
-- One batch's counts ($2 'table/kind' -> $3 rows), in that batch's transaction.
UPDATE purge_runs AS p
SET batches = p.batches + 1,
    counts = p.counts || (
        SELECT coalesce(jsonb_object_agg(t.k, coalesce((p.counts ->> t.k)::bigint, 0) + t.n),
                        '{}')
        FROM unnest($2::text[], $3::bigint[]) AS t(k, n))
WHERE p.id = $1;

-- name: purge_totals_add
-- The counter behind relay_purge_rows_total: $1 tables, $2 kinds, $3 rows (one per pair).
INSERT INTO purge_totals (table_name, kind, rows)
SELECT t, k, n FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(t, k, n) WHERE n > 0
ON CONFLICT (table_name, kind) DO UPDATE SET rows = purge_totals.rows + excluded.rows;

-- name: purge_run_finish
UPDATE purge_runs SET status = $2, finished_at = now(), error = $3
WHERE id = $1 AND status = 'running';

-- name: purge_horizon_rows
-- Raised before any delivery row older than $1 is deleted; never lowered.
UPDATE retention_horizon
SET rows_purged_before = greatest(coalesce(rows_purged_before, '-infinity'), $1);

-- name: purge_horizon_event_content
UPDATE retention_horizon
SET event_content_purged_before = greatest(coalesce(event_content_purged_before, '-infinity'), $1);

-- name: purge_content_pick
-- Final deliveries of channel $1 whose content is kept and is due to go: ended before $2
-- (a dead one before $3), after the keyset ($4 finished_at, $5 id); $6 at most.
-- passed_over: the rows step of this run deletes the row (as purge_rows_pick: past the row
-- cutoff $7, a dead one past $8, not the evidence of a suppression still kept, audit cutoff
-- $9), so stripping it first would be work thrown away. Marked rather than filtered out, so
-- one pick reads at most $6 rows however many of them are passed over.
SELECT d.id, d.finished_at,
       coalesce(d.finished_at < $7 AND (d.state <> 'dead' OR d.finished_at < $8)
                AND NOT EXISTS (SELECT 1 FROM suppressions AS s
                                WHERE s.delivery_id = d.id
                                  AND (s.removed_at IS NULL OR $9::timestamptz IS NULL
                                       OR s.removed_at >= $9)),
                false) AS passed_over
FROM deliveries AS d
WHERE d.channel = $1 AND d.finished_at IS NOT NULL AND d.content_purged_at IS NULL
  AND d.finished_at < $2 AND (d.state <> 'dead' OR d.finished_at < $3)
  AND (d.finished_at, d.id) > ($4::timestamptz, $5::bigint)
ORDER BY d.finished_at, d.id
LIMIT $6;

-- name: purge_content_excerpts
-- How many reply excerpts purging the content of deliveries $1 clears (a dry run's count).
SELECT count(*) FROM delivery_attempts
WHERE delivery_id = ANY($1::bigint[]) AND response_excerpt IS NOT NULL;

-- name: purge_content_apply
-- Purge the content of deliveries $1 still due to (as purge_content_pick): the payload, an
-- e-mail's or SMS's recipient, every reply excerpt. Returns how many of each.
WITH locked AS (
    SELECT id FROM deliveries
    WHERE id = ANY($1::bigint[]) AND finished_at IS NOT NULL AND content_purged_at IS NULL
      AND finished_at < $2 AND (state <> 'dead' OR finished_at < $3)
    ORDER BY id
    FOR UPDATE SKIP LOCKED
), excerpts AS (
    UPDATE delivery_attempts AS a SET response_excerpt = NULL
    FROM locked
    WHERE a.delivery_id = locked.id AND a.response_excerpt IS NOT NULL
    RETURNING 1
), purged AS (
    UPDATE deliveries AS d
    SET content_purged_at = now(), payload = NULL,
        destination = CASE WHEN d.channel IN ('email', 'sms') THEN NULL ELSE d.destination END
    FROM locked
    WHERE d.id = locked.id
    RETURNING 1
)
SELECT (SELECT count(*) FROM purged) AS deliveries, (SELECT count(*) FROM excerpts) AS excerpts;

-- name: purge_event_content_pick
-- Events whose payload is due to go: created before $1, after the keyset ($2, $3); $4 at most.
SELECT id, created_at FROM events
WHERE content_purged_at IS NULL AND created_at < $1
  AND (created_at, id) > ($2::timestamptz, $3::bigint)
ORDER BY created_at, id
LIMIT $4;

-- name: purge_event_content_apply
WITH locked AS (
    SELECT id FROM events
    WHERE id = ANY($1::bigint[]) AND content_purged_at IS NULL AND created_at < $2
    ORDER BY id
    FOR UPDATE SKIP LOCKED
)
UPDATE events AS e SET payload = NULL, content_purged_at = now()
FROM locked WHERE e.id = locked.id
RETURNING e.id;

-- name: purge_rows_pick
-- Final deliveries of channel $1 whose row is due to go: ended before $2 (a dead one before
-- $3), after the keyset ($4, $5), and not the evidence of a suppression still kept (in
-- force, or lifted after the audit cutoff $6); $7 at most.
SELECT d.id, d.finished_at FROM deliveries AS d
WHERE d.channel = $1 AND d.finished_at IS NOT NULL
  AND d.finished_at < $2 AND (d.state <> 'dead' OR d.finished_at < $3)
  AND (d.finished_at, d.id) > ($4::timestamptz, $5::bigint)
  AND NOT EXISTS (SELECT 1 FROM suppressions AS s
                  WHERE s.delivery_id = d.id
                    AND (s.removed_at IS NULL OR $6::timestamptz IS NULL OR s.removed_at >= $6))
ORDER BY d.finished_at, d.id
LIMIT $7;

-- name: purge_rows_lock
-- Lock the deliveries of $1 still due to go (as purge_rows_pick, $2 $3 $4 its cutoffs).
SELECT d.id FROM deliveries AS d
WHERE d.id = ANY($1::bigint[]) AND d.finished_at IS NOT NULL
  AND d.finished_at < $2 AND (d.state <> 'dead' OR d.finished_at < $3)
  AND NOT EXISTS (SELECT 1 FROM suppressions AS s
                  WHERE s.delivery_id = d.id
                    AND (s.removed_at IS NULL OR $4::timestamptz IS NULL OR s.removed_at >= $4))
ORDER BY d.id
FOR UPDATE SKIP LOCKED;

-- name: purge_rows_children_count
-- What deleting deliveries $1 deletes with them, table by table (a dry run's count).
SELECT (SELECT count(*) FROM delivery_attempts WHERE delivery_id = ANY($1::bigint[]))
           AS delivery_attempts,
       (SELECT count(*) FROM receipts WHERE delivery_id = ANY($1::bigint[])) AS receipts,
       (SELECT count(*) FROM reconciliations WHERE delivery_id = ANY($1::bigint[]))
           AS reconciliations;

-- name: purge_rows_children
-- Children first: every row that names deliveries $1 (locked by purge_rows_lock).
WITH a AS (DELETE FROM delivery_attempts WHERE delivery_id = ANY($1::bigint[]) RETURNING 1),
     r AS (DELETE FROM receipts WHERE delivery_id = ANY($1::bigint[]) RETURNING 1),
     c AS (DELETE FROM reconciliations WHERE delivery_id = ANY($1::bigint[]) RETURNING 1)
SELECT (SELECT count(*) FROM a) AS delivery_attempts, (SELECT count(*) FROM r) AS receipts,
       (SELECT count(*) FROM c) AS reconciliations;

-- name: purge_rows_run_counts
-- Before deliveries $1 go, their runs keep what became of them ('channel/state/skip
-- reason' -> rows), so the run report still counts them.
UPDATE publish_runs AS p SET purged_counts = p.purged_counts || m.counts
FROM (
    SELECT c.run_id,
           jsonb_object_agg(c.key, coalesce((r.purged_counts ->> c.key)::int, 0) + c.n) AS counts
    FROM (SELECT run_id,
                 channel || '/' || state::text || '/' || coalesce(skip_reason, '') AS key,
                 count(*)::int AS n
          FROM deliveries
          WHERE id = ANY($1::bigint[]) AND run_id IS NOT NULL
          GROUP BY run_id, key) AS c
    JOIN publish_runs AS r ON r.id = c.run_id
    GROUP BY c.run_id
) AS m
WHERE p.id = m.run_id;

-- name: purge_rows_delete
-- The deliveries themselves (final only, whatever a caller passes).
DELETE FROM deliveries WHERE id = ANY($1::bigint[]) AND finished_at IS NOT NULL
RETURNING channel;

-- name: purge_events_pick
-- Events created before $1 that no delivery names any more, after the keyset ($2, $3).
SELECT e.id, e.created_at FROM events AS e
WHERE e.created_at < $1 AND (e.created_at, e.id) > ($2::timestamptz, $3::bigint)
  AND NOT EXISTS (SELECT 1 FROM deliveries AS d WHERE d.event_id = e.id)
ORDER BY e.created_at, e.id
LIMIT $4;

-- name: purge_events_delete
WITH locked AS (
    SELECT e.id FROM events AS e
    WHERE e.id = ANY($1::bigint[]) AND e.created_at < $2
      AND NOT EXISTS (SELECT 1 FROM deliveries AS d WHERE d.event_id = e.id)
    ORDER BY e.id
    FOR UPDATE SKIP LOCKED
)
DELETE FROM events AS e USING locked WHERE e.id = locked.id RETURNING e.id;

-- name: purge_runs_pick
-- Publish runs that finished before $1 and have no delivery left, nor a run action kept
-- (one after the audit cutoff $4; NULL: every one is kept), after the keyset ($2, $3).
SELECT p.id, p.finished_at FROM publish_runs AS p
WHERE p.finished_at < $1 AND (p.finished_at, p.id) > ($2::timestamptz, $3::bigint)
  AND NOT EXISTS (SELECT 1 FROM deliveries AS d WHERE d.run_id = p.id)
  AND NOT EXISTS (SELECT 1 FROM run_actions AS a
                  WHERE a.run_id = p.id AND ($4::timestamptz IS NULL OR a.at >= $4))
ORDER BY p.finished_at, p.id
LIMIT $5;

-- name: purge_runs_delete
-- (Run actions past the audit period went first, in the audit step.)
WITH locked AS (
    SELECT p.id FROM publish_runs AS p
    WHERE p.id = ANY($1::bigint[]) AND p.finished_at < $2
      AND NOT EXISTS (SELECT 1 FROM deliveries AS d WHERE d.run_id = p.id)
      AND NOT EXISTS (SELECT 1 FROM run_actions AS a WHERE a.run_id = p.id)
    ORDER BY p.id
    FOR UPDATE SKIP LOCKED
)
DELETE FROM publish_runs AS p USING locked WHERE p.id = locked.id RETURNING p.id;

-- name: purge_audit_count
-- The audit trail due to go before $1, table by table (a dry run's count; the predicates
-- are those of the purge_audit_* deletes below).
SELECT (SELECT count(*) FROM run_actions AS a WHERE a.at < $1
          AND NOT EXISTS (SELECT 1 FROM deliveries AS d WHERE d.stop_action_id = a.id))
           AS run_actions,
       (SELECT count(*) FROM destination_actions WHERE at < $1) AS destination_actions,
       (SELECT count(*) FROM replays WHERE started_at < $1) AS replays,
       (SELECT count(*) FROM console_reveals WHERE at < $1) AS console_reveals,
       (SELECT count(*) FROM console_sessions WHERE expires_at < $1) AS console_sessions,
       (SELECT count(*) FROM admission_pauses WHERE resumed_at < $1) AS admission_pauses,
       (SELECT count(*) FROM suppressions WHERE removed_at < $1) AS suppressions,
       (SELECT count(*) FROM purge_runs WHERE finished_at < $1) AS purge_runs;

-- name: purge_audit_run_actions
-- Run actions before $1, $2 at most; never one an open delivery still names (a stop).
DELETE FROM run_actions WHERE id IN (
    SELECT a.id FROM run_actions AS a
    WHERE a.at < $1
      AND NOT EXISTS (SELECT 1 FROM deliveries AS d WHERE d.stop_action_id = a.id)
    ORDER BY a.id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_destination_actions
DELETE FROM destination_actions WHERE id IN (
    SELECT id FROM destination_actions WHERE at < $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_replays
-- Replays and drops of dead letters (the dead-letter audit), by when they started.
DELETE FROM replays WHERE id IN (
    SELECT id FROM replays WHERE started_at < $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_console_reveals
DELETE FROM console_reveals WHERE id IN (
    SELECT id FROM console_reveals WHERE at < $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_console_sessions
-- Sessions that ended (expired) before $1: a live one is never touched.
DELETE FROM console_sessions WHERE id IN (
    SELECT id FROM console_sessions WHERE expires_at < $1
    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_admission_pauses
-- Pause windows closed before $1 (the open one, if any, stays).
DELETE FROM admission_pauses WHERE id IN (
    SELECT id FROM admission_pauses WHERE resumed_at < $1
    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_suppressions
-- Suppressions an operator lifted before $1 (one in force is never touched).
DELETE FROM suppressions WHERE id IN (
    SELECT id FROM suppressions WHERE removed_at < $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: purge_audit_purge_runs
-- Purge runs that finished before $1 (the running one has no finished_at).
DELETE FROM purge_runs WHERE id IN (
    SELECT id FROM purge_runs WHERE finished_at < $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: retention_horizon
SELECT rows_purged_before, event_content_purged_before FROM retention_horizon;

-- name: retention_last_purge
-- When the newest purge run finished whole; before the first, when retention was installed.
SELECT coalesce((SELECT finished_at FROM purge_runs WHERE status = 'ok'
                 ORDER BY finished_at DESC LIMIT 1),
                (SELECT installed_at FROM retention_horizon));

-- name: retention_oldest_final
-- Per channel, the age of the oldest final delivery kept and of the oldest still holding
-- its content (two index reads each: deliveries_final_idx, deliveries_content_kept_idx).
SELECT c.channel,
       extract(epoch FROM now() - (
           SELECT finished_at FROM deliveries
           WHERE channel = c.channel AND finished_at IS NOT NULL
           ORDER BY finished_at LIMIT 1))::float8 AS final_seconds,
       extract(epoch FROM now() - (
           SELECT finished_at FROM deliveries
           WHERE channel = c.channel AND finished_at IS NOT NULL AND content_purged_at IS NULL
           ORDER BY finished_at LIMIT 1))::float8 AS content_seconds
FROM (VALUES ('webhook'), ('email'), ('sms')) AS c(channel);

-- name: retention_purge_totals
SELECT table_name, kind, rows FROM purge_totals;

---------------------------------------------------------------------------- erasure
-- `relay erase` (service/erasure.py): one recipient's data, table by table, in one
-- transaction (rolled back for a dry run). Which column gets what, and why: the list in
-- service/erasure_columns.py. Parameters: $1 the channel, $2 the recipient's stored
-- spellings (exact values), $3 its reminders' ids; a scrub's $1 is the mention pattern.

-- name: erase_spellings
-- Every stored value that may be the recipient (the address lower-cased, or a URL's scheme
-- and host, $2): the caller keeps those whose normalised form is the recipient's.
SELECT destination AS stored FROM reminders
WHERE channel = $1 AND starts_with(lower(destination), $2)
UNION
SELECT destination FROM deliveries
WHERE channel = $1 AND destination IS NOT NULL AND starts_with(lower(destination), $2)
UNION
SELECT address FROM suppressions WHERE channel = $1 AND starts_with(lower(address), $2)
UNION
SELECT url FROM destinations WHERE $1 = 'webhook' AND starts_with(lower(url), $2);

-- name: erase_reminders_of
-- The recipient's reminders not erased yet, locked in id order first (as a load locks
-- them), so no publish run admits for them meanwhile and no load edits them.
SELECT id FROM reminders
WHERE channel = $1 AND destination = ANY($2::text[])
  AND inactive_reason IS DISTINCT FROM 'erased'
ORDER BY id
FOR UPDATE;

-- name: erase_in_flight
-- The recipient's deliveries not final, locked in id order: a consumer's claim waits for
-- the erasure and then finds them skipped. One in 'sending' is in flight: the erasure is
-- refused (its request may be on the wire; its outcome is still to be written).
SELECT id, state::text AS state, lease_expires_at FROM deliveries
WHERE ((channel = $1 AND destination = ANY($2::text[]))
       OR (source = 'schedule' AND destination IS NULL AND reminder_id = ANY($3::text[])))
  AND erased_at IS NULL AND state IN ('pending', 'queued', 'sending', 'retrying')
ORDER BY id
FOR UPDATE;

-- name: erase_reminders
-- The recipient's reminders become tombstones: id and schedule kept, no destination, no
-- payload, inactive for good ('erased'), nothing more to fire.
WITH changed AS (
    UPDATE reminders SET destination = 'erased', payload = '{}'::jsonb, active = false,
                         inactive_reason = 'erased', next_due_at = NULL, updated_at = now()
    WHERE id = ANY($1::text[]) AND inactive_reason IS DISTINCT FROM 'erased'
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_deliveries
-- The recipient's deliveries (its own destination, or its reminders' rows, which read the
-- reminder's): those not sent yet -> skipped ('erased'); every one loses its destination,
-- payload, last error and receipt (an outbox row keeps the placeholders its CHECK needs)
-- and is stamped erased. A row claimed meanwhile is left out (the caller then refuses).
WITH mine AS (
    SELECT id, state FROM deliveries
    WHERE ((channel = $1 AND destination = ANY($2::text[]))
           OR (source = 'schedule' AND destination IS NULL AND reminder_id = ANY($3::text[])))
      AND erased_at IS NULL AND state <> 'sending'
    ORDER BY id
    FOR UPDATE
), changed AS (
    UPDATE deliveries AS d SET
        state = CASE WHEN m.open THEN 'skipped'::delivery_state ELSE d.state END,
        skip_reason = CASE WHEN m.open THEN 'erased' ELSE d.skip_reason END,
        finished_at = CASE WHEN m.open THEN now() ELSE d.finished_at END,
        next_attempt_at = NULL,
        stop_action_id = CASE WHEN m.open THEN NULL ELSE d.stop_action_id END,
        -- A row whose content retention purged already has no payload (and an e-mail or
        -- SMS no destination): it stays without (deliveries_outbox_content).
        destination = CASE WHEN d.source = 'outbox'
                                AND (d.content_purged_at IS NULL OR d.channel = 'webhook')
                           THEN 'erased' END,
        payload = CASE WHEN d.source = 'outbox' AND d.content_purged_at IS NULL
                       THEN '{}'::jsonb END,
        last_error = NULL, receipt = NULL, erased_at = now()
    FROM (SELECT id, state, state IN ('pending', 'queued', 'retrying') AS open FROM mine) AS m
    WHERE d.id = m.id AND d.state = m.state
    RETURNING d.id, m.open
)
SELECT id, open FROM changed;

-- name: erase_attempts
-- The attempts of the recipient's deliveries ($1): no reply excerpt, no error text (a
-- provider's answer may echo the address). Outcome, status, times and message id stay.
WITH changed AS (
    UPDATE delivery_attempts SET response_excerpt = NULL, error = NULL
    WHERE delivery_id = ANY($1::bigint[])
      AND (response_excerpt IS NOT NULL OR error IS NOT NULL)
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_receipts
-- The receipts of the recipient's deliveries ($1): deleted (append-only: never rewritten).
WITH gone AS (DELETE FROM receipts WHERE delivery_id = ANY($1::bigint[]) RETURNING 1)
SELECT count(*)::int FROM gone;

-- name: erase_reconciliations
WITH changed AS (
    UPDATE reconciliations SET error = NULL, provider_status = NULL
    WHERE delivery_id = ANY($1::bigint[])
      AND (error IS NOT NULL OR provider_status IS NOT NULL)
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_suppressions
-- The recipient's suppressions, lifted or in force: the address is the row.
WITH gone AS (
    DELETE FROM suppressions WHERE channel = $1 AND address = ANY($2::text[]) RETURNING 1
)
SELECT count(*)::int FROM gone;

-- name: erase_event_subscriptions
WITH gone AS (DELETE FROM event_subscriptions WHERE url = ANY($1::text[]) RETURNING 1)
SELECT count(*)::int FROM gone;

-- name: erase_destination_actions
WITH gone AS (DELETE FROM destination_actions WHERE url = ANY($1::text[]) RETURNING 1)
SELECT count(*)::int FROM gone;

-- name: erase_destination_secrets
WITH gone AS (DELETE FROM destination_secrets WHERE url = ANY($1::text[]) RETURNING 1)
SELECT count(*)::int FROM gone;

-- name: erase_destinations
-- The registry's row of the recipient's URL (after what references it, above).
WITH gone AS (DELETE FROM destinations WHERE url = ANY($1::text[]) RETURNING 1)
SELECT count(*)::int FROM gone;

-- name: erase_scrub_reminders
-- Mentions ($1, case-insensitive) in other reminders' payloads -> '[erased]'.
WITH hit AS (
    SELECT id FROM reminders WHERE payload::text ~* $1 ORDER BY id FOR UPDATE
), changed AS (
    UPDATE reminders AS r SET payload = regexp_replace(r.payload::text, $1, '[erased]', 'gi')::jsonb
    FROM hit WHERE r.id = hit.id
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_deliveries
-- Mentions in any delivery's payload (an event's copy), last error or receipt; locked in
-- id order, as every statement that locks several deliveries.
WITH hit AS (
    SELECT id FROM deliveries
    WHERE payload::text ~* $1 OR last_error ~* $1 OR receipt ~* $1
    ORDER BY id
    FOR UPDATE
), changed AS (
    UPDATE deliveries AS d SET
        payload = CASE WHEN d.payload::text ~* $1
                       THEN regexp_replace(d.payload::text, $1, '[erased]', 'gi')::jsonb
                       ELSE d.payload END,
        last_error = left(regexp_replace(d.last_error, $1, '[erased]', 'gi'), 500),
        receipt = left(regexp_replace(d.receipt, $1, '[erased]', 'gi'), 500)
    FROM hit WHERE d.id = hit.id
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_attempts
WITH changed AS (
    UPDATE delivery_attempts SET
        response_excerpt = left(regexp_replace(response_excerpt, $1, '[erased]', 'gi'), 1000),
        error = left(regexp_replace(error, $1, '[erased]', 'gi'), 500)
    WHERE response_excerpt ~* $1 OR error ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_suppressions
WITH changed AS (
    UPDATE suppressions SET
        detail = left(regexp_replace(detail, $1, '[erased]', 'gi'), 500),
        removed_reason = left(regexp_replace(removed_reason, $1, '[erased]', 'gi'), 500)
    WHERE detail ~* $1 OR removed_reason ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_destinations
WITH changed AS (
    UPDATE destinations SET
        disabled_reason = left(regexp_replace(disabled_reason, $1, '[erased]', 'gi'), 500)
    WHERE disabled_reason ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_destination_actions
WITH changed AS (
    UPDATE destination_actions SET
        reason = left(regexp_replace(reason, $1, '[erased]', 'gi'), 500)
    WHERE reason ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_event_subscriptions
WITH changed AS (
    UPDATE event_subscriptions SET
        filter = regexp_replace(filter::text, $1, '[erased]', 'gi')::jsonb
    WHERE filter::text ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_events
WITH changed AS (
    UPDATE events SET payload = regexp_replace(payload::text, $1, '[erased]', 'gi')::jsonb
    WHERE payload::text ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_event_types
WITH changed AS (
    UPDATE event_types SET
        description = left(regexp_replace(description, $1, '[erased]', 'gi'), 500),
        schema = CASE WHEN schema::text ~* $1
                      THEN regexp_replace(schema::text, $1, '[erased]', 'gi')::jsonb
                      ELSE schema END
    WHERE description ~* $1 OR schema::text ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_publish_runs
WITH changed AS (
    UPDATE publish_runs SET error = regexp_replace(error, $1, '[erased]', 'gi')
    WHERE error ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_run_actions
WITH changed AS (
    UPDATE run_actions SET reason = left(regexp_replace(reason, $1, '[erased]', 'gi'), 500)
    WHERE reason ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_replays
WITH changed AS (
    UPDATE replays SET filters = regexp_replace(filters::text, $1, '[erased]', 'gi')::jsonb
    WHERE filters::text ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_scrub_console_reveals
WITH changed AS (
    UPDATE console_reveals SET page = left(regexp_replace(page, $1, '[erased]', 'gi'), 300)
    WHERE page ~* $1
    RETURNING 1
)
SELECT count(*)::int FROM changed;

-- name: erase_left_unerased
-- After every step: the recipient's deliveries still not erased (claimed while the
-- erasure ran: a row admitted or added meanwhile). Any: the caller refuses, rolling back.
SELECT id, state::text AS state, lease_expires_at FROM deliveries
WHERE ((channel = $1 AND destination = ANY($2::text[]))
       OR (source = 'schedule' AND destination IS NULL AND reminder_id = ANY($3::text[])))
  AND erased_at IS NULL
ORDER BY id;

-- name: erase_no_deadline
-- An erasure reads whole tables (the scrubs): no statement deadline in its transaction.
SET LOCAL statement_timeout = 0;

-- name: erasure_record
INSERT INTO erasures (channel, recipient_ref, operator, reason, counts)
VALUES ($1, $2, $3, $4, $5)
RETURNING id, at;

-- name: erasures_of
-- Earlier erasures of the same recipient (its keyed hash), oldest first.
SELECT id, channel, operator, reason, counts, at FROM erasures
WHERE recipient_ref = $1
ORDER BY id;
