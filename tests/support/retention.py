"""A ledger with a history, for the retention tests: deliveries of every kind in final and
open states, made through the ledger's own functions (admission, the outbox, claim,
complete, receipts, reconciliations, suppressions, run actions, the console's records), then
dated back by the given number of days (the one thing only a test does to the ledger).

``seed`` makes the standard history the tests and the fault test share; ``EXPECTED`` is
what the default policy (README defaults) purges of it, run by run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from service import (
    destinations,
    events,
    ledger,
    outbox,
    receipts,
    reconciliations,
    runs,
    subscriptions,
    suppressions,
)
from service.db import q
from service.ledger import Attempt, Completion, State, admission, publish_runs, sending
from service.receipt_events import ReceiptEvent
from service.settings import Settings
from tests.support import relay as rs

HOOK = "http://127.0.0.1:9/hooks/"
EVENT_TYPE = "shipment.delayed"


@dataclass(frozen=True)
class Spec:
    """One delivery: its channel, the state it ends in, and how many days ago it ended
    (final) or was created (open)."""

    label: str
    channel: str
    state: str
    days: float
    run: str | None = None  # a publish run's label: a scheduled occurrence of that run
    event: str | None = None  # an event's label: that event's delivery
    bounce: str | None = None  # "kept" / "lifted": a permanent bounce suppressed the address
    reconciled: bool = False


# Runs: label -> days since it finished.
RUNS = {"a": 200.0, "b_empty": 500.0, "c": 450.0, "d": 1.0}
EVENTS = {"e_old": 100.0, "e_mid": 40.0, "e_new": 10.0}
SPECS = (
    Spec("a_delivered", "webhook", "delivered", 100, run="a"),
    Spec("a_paused", "webhook", "skipped", 100, run="a"),
    Spec("a_dead", "webhook", "dead", 100, run="a"),
    Spec("a_retrying", "webhook", "retrying", 300, run="a"),
    Spec("a_sms_dead", "sms", "dead", 200, run="a"),
    Spec("c_delivered", "webhook", "delivered", 450, run="c"),
    Spec("d_delivered", "webhook", "delivered", 1, run="d"),
    Spec("d_pending", "webhook", "pending", 1, run="d"),
    Spec("o_webhook_40", "webhook", "delivered", 40),
    Spec("o_webhook_10", "webhook", "delivered", 10),
    Spec("o_email_accepted_20", "email", "accepted", 20, reconciled=True),
    Spec("o_email_suppressed_100", "email", "bounced", 100, bounce="kept"),
    Spec("o_email_lifted_500", "email", "bounced", 500, bounce="lifted"),
    Spec("o_sms_100", "sms", "delivered", 100, reconciled=True),
    Spec("o_email_pending_300", "email", "pending", 300),
    Spec("o_sms_sending_200", "sms", "sending", 200),
    Spec("e_old_d", "webhook", "delivered", 100, event="e_old"),
    Spec("e_mid_d", "webhook", "delivered", 40, event="e_mid"),
    Spec("e_new_d", "webhook", "delivered", 10, event="e_new"),
)
# Labels of the rows never final: a purge must leave them exactly as they are.
OPEN = ("a_retrying", "d_pending", "o_email_pending_300", "o_sms_sending_200")

# What the default policy purges of the seeded history: the first run, then the second
# (events and runs whose last delivery went in the first), then nothing.
_AUDIT = dict.fromkeys(
    ("run_actions", "destination_actions", "replays", "console_reveals", "console_sessions",
     "admission_pauses", "suppressions"), 1
)  # fmt: skip
EXPECTED = (
    {
        # Content only of the rows kept: the 7 whose rows go are not stripped first.
        "content": {"deliveries": 5, "delivery_attempts": 5, "events": 2},
        "rows": {"deliveries": 7, "delivery_attempts": 6, "receipts": 2, "reconciliations": 1,
                 "events": 0, "publish_runs": 1, **_AUDIT, "purge_runs": 0},
        "deliveries_by_channel": {"content": {"webhook": 3, "email": 2},
                                  "rows": {"webhook": 4, "email": 1, "sms": 2}},
    },
    {"content": {}, "rows": {"events": 1, "publish_runs": 1}},
)  # fmt: skip
# After both runs: the labels whose rows are gone, and those whose content is.
DELETED = ("a_delivered", "a_paused", "a_sms_dead", "c_delivered", "o_email_lifted_500",
           "o_sms_100", "e_old_d")  # fmt: skip
CONTENT_PURGED = ("a_dead", "o_webhook_40", "o_email_accepted_20", "o_email_suppressed_100",
                  "e_mid_d")  # fmt: skip


@dataclass
class Seeded:
    deliveries: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)


async def seed(pool: asyncpg.Pool) -> Seeded:
    """The standard history (SPECS, RUNS, EVENTS and an old and a new record of each kind
    of audit), dated back from the database's clock now."""
    now = await pool.fetchval(q("db_now"))
    seeded = Seeded()
    async with pool.acquire() as conn:
        for label, days in RUNS.items():
            seeded.runs[label] = await _run(conn, now - timedelta(days=days))
        await _event_catalogue(conn)
        for spec in SPECS:
            seeded.deliveries[spec.label] = await _delivery(conn, spec, seeded, now)
        await _audit(conn, seeded.runs["a"], now)
    return seeded


async def seed_final(pool: asyncpg.Pool, specs: list[Spec]) -> dict[str, int]:
    """Just these deliveries (outbox intents, no run, no event): label -> id."""
    now = await pool.fetchval(q("db_now"))
    async with pool.acquire() as conn:
        return {spec.label: await _delivery(conn, spec, Seeded(), now) for spec in specs}


async def _run(conn: ledger.Connection, finished: datetime) -> int:
    started = await publish_runs.start(conn, "publish", finished, "seed")
    await publish_runs.finish(conn, started.run_id, "ok", due=0, created=0, skipped=0, published=0,
                      rescued=0, failed=0, error=None)  # fmt: skip
    await conn.execute(
        "UPDATE publish_runs SET intended_fire_at = $2, started_at = $2, finished_at = $2"
        " WHERE id = $1",
        started.run_id,
        finished,
    )
    return started.run_id


async def _event_catalogue(conn: ledger.Connection) -> None:
    await events.add_type(conn, EVENT_TYPE, "", None)
    async with conn.transaction():
        await destinations.enter(conn, [HOOK + "events"], destinations.Registration())
    await subscriptions.subscribe(conn, HOOK + "events", EVENT_TYPE, {}, None)


def _destination(spec: Spec) -> str:
    if spec.channel == "email":
        return f"{spec.label.replace('_', '-')}@example.com"
    if spec.channel == "sms":
        return "+1415555" + str(
            int(hashlib.sha256(spec.label.encode()).hexdigest(), 16) % 10_000
        ).zfill(4)
    return HOOK + spec.label


def _payload(spec: Spec) -> dict[str, Any]:
    if spec.channel == "email":
        return {"subject": f"About {spec.label}", "text": "private text"}
    if spec.channel == "sms":
        return {"body": f"private text {spec.label}"}
    return {"text": f"private text {spec.label}"}


async def _insert(conn: ledger.Connection, spec: Spec, seeded: Seeded, now: datetime) -> int:
    async with conn.transaction():
        if spec.run is not None:
            skip = "paused" if spec.state == "skipped" else None
            at = now - timedelta(days=spec.days, hours=1)
            key = admission.schedule_key(spec.label, at, spec.channel)
            new = admission.NewDelivery(
                key, spec.label, spec.channel, spec.channel, at, False, skip
            )
            (inserted,) = await admission.insert_deliveries(conn, [new], seeded.runs[spec.run])
            return inserted.id
        if spec.event is not None:
            recorded = await outbox.add_event(
                conn, key=spec.event, event_type=EVENT_TYPE, payload={"about": spec.event}
            )
            assert recorded is not None
            seeded.events[spec.event] = recorded.event_id
            return int(await conn.fetchval(
                "SELECT id FROM deliveries WHERE event_id = $1", recorded.event_id))  # fmt: skip
        found = await outbox.add_intent(
            conn, key=spec.label, channel=spec.channel,  # type: ignore[arg-type]
            destination=_destination(spec), payload=_payload(spec), allow_networks=rs.LOOPBACK,
        )  # fmt: skip
        assert found is not None
        return found


async def _delivery(conn: ledger.Connection, spec: Spec, seeded: Seeded, now: datetime) -> int:
    delivery_id = await _insert(conn, spec, seeded, now)
    if spec.state not in ("pending", "skipped"):
        claimed, _ = await sending.claim(conn, [delivery_id], 600.0)
        assert delivery_id in claimed
    if spec.state not in ("pending", "skipped", "sending"):
        await _outcome(conn, spec, delivery_id)
    if spec.reconciled:
        await reconciliations.record(conn, reconciliations.Reconciliation(
            delivery_id, 1, (1,), "unknown", "resend_same_key", error="timed out"))  # fmt: skip
    await _date_back(conn, spec, delivery_id, now)
    return delivery_id


_ANSWER = {
    "retrying": (State.RETRYING, "retry", 503),
    "dead": (State.DEAD, "rejected", 404),
    "delivered": (State.DELIVERED, "accepted", 200),
    "accepted": (State.ACCEPTED, "accepted", 202),
    "bounced": (State.ACCEPTED, "accepted", 202),
}


async def _outcome(conn: ledger.Connection, spec: Spec, delivery_id: int) -> None:
    state, outcome, status = _ANSWER[spec.state]
    receipted = spec.channel != "webhook"
    if state is State.DELIVERED and receipted:
        state = State.ACCEPTED  # e-mail and SMS: delivered by a receipt, below
    message = f"msg-{delivery_id}" if receipted and outcome == "accepted" else None
    error = None if status < 300 else f"http {status}"
    reply = f"reply to {spec.label} for ann@example.com"
    attempt = Attempt(outcome, status, 5.0, error, reply, provider_message_id=message)
    retry_at = await conn.fetchval("SELECT now() + interval '1 hour'")
    retry = retry_at if state is State.RETRYING else None
    completion = Completion(delivery_id, 1, state, retry, status, error, record=attempt)
    done = await sending.complete(conn, [completion])
    assert done == {(delivery_id, 1)}
    if message is not None and spec.state in ("delivered", "bounced"):
        bounced = spec.state == "bounced"
        event = ReceiptEvent(spec.channel, message, f"evt-{delivery_id}",
                             "email.bounced" if bounced else "delivered",
                             "bounced" if bounced else "delivered", permanent=bounced,
                             reason="Permanent/General" if bounced else None)  # fmt: skip
        await receipts.record(conn, event, delivery_id)
    if spec.bounce == "lifted":
        lifted = await suppressions.remove(conn, spec.channel, _destination(spec), "oncall", "ok")
        assert lifted is not None


async def _date_back(conn: ledger.Connection, spec: Spec, delivery_id: int, now: datetime) -> None:
    at = now - timedelta(days=spec.days)
    await conn.execute(
        "UPDATE deliveries SET created_at = $2::timestamptz - interval '1 hour',"
        " first_attempt_at = $2, finished_at = CASE WHEN finished_at IS NOT NULL THEN $2 END,"
        " settled_at = CASE WHEN settled_at IS NOT NULL THEN $2 END WHERE id = $1",
        delivery_id,
        at,
    )
    await conn.execute(
        "UPDATE delivery_attempts SET started_at = $2, finished_at = $2 WHERE delivery_id = $1",
        delivery_id,
        at,
    )
    # (receipts are append-only: they keep the time they came; purge goes by the delivery's)
    await conn.execute(
        "UPDATE suppressions SET created_at = $2,"
        " removed_at = CASE WHEN removed_at IS NOT NULL"
        "                   THEN $2::timestamptz + interval '50 days' END"
        " WHERE delivery_id = $1",
        delivery_id,
        at,
    )
    if spec.event is not None:
        await conn.execute(
            "UPDATE events SET created_at = $2 WHERE key = $1", spec.event, at - timedelta(hours=1)
        )


async def _audit(conn: ledger.Connection, run_id: int, now: datetime) -> None:
    """An old (500 days) and a new (10 days) record of each kind of audit."""
    for days in (500, 10):
        at = now - timedelta(days=days)
        action = await conn.fetchrow(q("run_action_record"), run_id, "hold", "oncall", "x", 0)
        assert action is not None
        await conn.execute("UPDATE run_actions SET at = $2 WHERE id = $1", action["id"], at)
        await conn.execute(q("destination_action_record"), HOOK + "events", "disable", "oncall",
                           "x", {})  # fmt: skip
        await conn.execute("UPDATE destination_actions SET at = $1 WHERE at > $1", at)
        await conn.execute(
            "INSERT INTO replays (source, operator, filters, started_at, finished_at)"
            " VALUES ('ledger', 'oncall', '{}', $1, $1)",
            at,
        )
        await conn.execute(q("console_reveal_record"), "oncall", "/runs", at)
        ends = now + timedelta(hours=1) if days == 10 else at + timedelta(hours=12)
        await conn.execute(q("console_session_open"), hashlib.sha256(str(days).encode()).digest(),
                           "oncall", "line", "c" * 32, at, ends)  # fmt: skip
        await runs.set_admission_paused(conn, True, "oncall")
        await runs.set_admission_paused(conn, False, "oncall")
        await conn.execute(
            "UPDATE admission_pauses SET paused_at = $1, resumed_at = $1 WHERE resumed_at > $1", at
        )


async def counts(pool: asyncpg.Pool) -> dict[str, int]:
    """Rows per table the purge may touch."""
    tables = ("deliveries", "delivery_attempts", "receipts", "reconciliations", "events",
              "publish_runs", "run_actions", "destination_actions", "replays", "console_reveals",
              "console_sessions", "admission_pauses", "suppressions")  # fmt: skip
    return {t: await pool.fetchval(f"SELECT count(*) FROM {t}") for t in tables}


async def purge_json(settings: Settings, *args: str, **env: str) -> dict[str, Any]:
    """``relay purge --json ARGS`` as a real process (``env``: extra RELAY_* settings);
    its document, once it exited 0."""
    result = await rs.relay(settings, "purge", "--json", *args, **env)
    assert result.code == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data
