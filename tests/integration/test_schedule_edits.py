"""Schedule edits and backfill tell the truth (issue 24, item 6), through the real
pipeline: a reminder moved inside the publish look-ahead sends its new occurrence only, a
payload-only edit sends the original occurrence with the new payload, and a backfill
across a schedule change admits what each schedule owed while it was in force, its dry
run listing exactly what the apply admits. Real PostgreSQL, RabbitMQ, HTTP and ``relay``."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import asyncpg
import pytest

from service.ledger import admission
from service.ops import reminders
from service.settings import Settings
from tests.support import relay as rs
from tests.support.receivers import Receiver, receivers

__all__ = ["receivers"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)


async def _publish(settings: Settings) -> None:
    result = await rs.relay(settings, "publish")
    assert result.code == 0, result.stderr[-2000:]


async def _load(settings: Settings, folder: Path, *lines: str) -> str:
    """``relay reminders load`` of these lines; its summary line."""
    path = folder / "reminders.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines))
    result = await rs.relay(settings, "reminders", "load", str(path))
    assert result.code == 0, result.stderr
    return result.stdout.strip()


async def _rows(pool: asyncpg.Pool) -> list[tuple[datetime, str, str | None]]:
    rows = await pool.fetch(
        "SELECT occurrence_at, state::text AS state, skip_reason FROM deliveries ORDER BY 1"
    )
    return [(r["occurrence_at"], r["state"], r["skip_reason"]) for r in rows]


async def test_reminder_moved_inside_the_lookahead_sends_the_new_occurrence_only(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver], tmp_path: Path
) -> None:
    receiver = receivers[0]
    start = datetime.now(UTC).replace(microsecond=0)
    # 'old' still ahead after a publish run and a load on a loaded machine (each a few s).
    old, new = start + timedelta(seconds=20), start + timedelta(seconds=25)
    await rs.load(pool, [rs.line("r1", receiver.url(), due_at=old)])
    await _publish(settings)  # the look-ahead admits 'old' (queued, its message timed)
    assert await _rows(pool) == [(old, "queued", None)]

    # "I moved it to +25 s": the edit skips the admitted +20 s in its own transaction.
    moved = await _load(settings, tmp_path, rs.line("r1", receiver.url(), due_at=new))
    assert moved == (
        "loaded 1 reminders; schedule changed for 1 (1 admitted occurrences skipped: rescheduled)"
    )
    assert await _rows(pool) == [(old, "skipped", "rescheduled")]
    await _publish(settings)
    assert await _rows(pool) == [(old, "skipped", "rescheduled"), (new, "queued", None)]

    async with rs.consumer_in_process(settings) as consumer:
        # Both messages arrive: the new one is sent; the old one finds its row final.
        await rs.wait_for(lambda: _final_and_acked(pool, consumer), 150, "both occurrences settled")
    assert await _rows(pool) == [(old, "skipped", "rescheduled"), (new, "delivered", None)]
    assert [r.headers["Idempotency-Key"] for r in receiver.requests] == [
        admission.schedule_key("r1", new, "webhook")
    ]
    attempts = await pool.fetchval("SELECT count(*) FROM delivery_attempts")
    assert attempts == 1


async def _final_and_acked(pool: asyncpg.Pool, consumer: rs.InProcessConsumer) -> bool:
    states = await rs.states(pool)
    return (
        states == {"skipped": 1, "delivered": 1}
        and consumer.metric("relay.delivery.duplicates", state="skipped") >= 1
    )


async def test_payload_only_edit_inside_the_lookahead_sends_that_occurrence_with_the_new_payload(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver], tmp_path: Path
) -> None:
    receiver = receivers[0]
    due = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=15)
    await rs.load(pool, [rs.line("r1", receiver.url(), due_at=due, payload={"text": "old"})])
    await _publish(settings)  # admitted through the look-ahead
    assert await _rows(pool) == [(due, "queued", None)]

    edit = rs.line("r1", receiver.url(), due_at=due, payload={"text": "new"})
    assert await _load(settings, tmp_path, edit) == "loaded 1 reminders"
    assert await _rows(pool) == [(due, "queued", None)]  # nothing skipped, nothing new
    versions = await pool.fetchval("SELECT count(*) FROM reminder_schedules")
    assert versions == 1  # the schedule did not change: no new version

    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _delivered(pool), 60, "the occurrence delivered")
    assert await _rows(pool) == [(due, "delivered", None)]
    assert [(r.headers["Idempotency-Key"], json.loads(r.body)) for r in receiver.requests] == [
        (admission.schedule_key("r1", due, "webhook"), {"text": "new"})
    ]


async def _delivered(pool: asyncpg.Pool) -> bool:
    return await rs.states(pool) == {"delivered": 1}


async def test_edit_to_a_schedule_that_still_has_the_admitted_occurrence_skips_nothing(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    url = receivers[0].url()
    await rs.load(pool, [rs.line("r1", url, cron="* * * * *")])
    await _publish(settings)  # admits the next minute (look-ahead 75 s)
    before = await _rows(pool)
    assert before and {(state, why) for _, state, why in before} == {("queued", None)}

    # Another zone with the same clock: a new schedule version, the same occurrences.
    await rs.load(pool, [rs.line("r1", url, cron="* * * * *", timezone="Etc/UTC")])
    assert await _rows(pool) == before
    history = await pool.fetch(
        "SELECT timezone, valid_to IS NULL AS current FROM reminder_schedules ORDER BY id"
    )
    assert [(r["timezone"], r["current"]) for r in history] == [("UTC", False), ("Etc/UTC", True)]


# ------------------------------------------------------------------------ backfill


async def test_backfill_across_a_schedule_change_admits_what_each_schedule_owed_then(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    url = receivers[0].url()
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    changed_at = now - timedelta(minutes=5, seconds=30)
    # Even minutes (UTC) until the change, odd minutes (Berlin) from then on; the loads
    # are told when they happened (the injected clock), the change 5.5 minutes ago.
    even = rs.line("r1", url, cron="0-59/2 * * * *")
    odd = rs.line("r1", url, cron="1-59/2 * * * *", timezone="Europe/Berlin")
    await reminders.load(pool, [even], rs.LOOPBACK, now=now - timedelta(minutes=20))
    await reminders.load(pool, [odd], rs.LOOPBACK, now=changed_at)
    start, end = now - timedelta(minutes=11), now - timedelta(minutes=1)
    minutes = [start + timedelta(minutes=m) for m in range(11)]
    before = [at for at in minutes if at < changed_at and at.minute % 2 == 0]
    after = [at for at in minutes if at >= changed_at and at.minute % 2 == 1]
    assert len(before) == 3 and len(after) in (2, 3)
    expected = before + after

    window = ("--reminder", "r1", "--from", start.isoformat(), "--to", end.isoformat())
    dry = await _backfill(settings, *window)
    listed = [(o["occurrence_at"], o["timezone"], o["action"]) for o in dry["occurrences"]]
    assert listed == [(at.isoformat(), "UTC", "new") for at in before] + [
        (at.isoformat(), "Europe/Berlin", "new") for at in after
    ]
    berlin = [o["local"] for o in dry["occurrences"] if o["timezone"] == "Europe/Berlin"]
    assert berlin == [at.astimezone(ZoneInfo("Europe/Berlin")).isoformat() for at in after]
    assert (dry["in_window"], dry["new"], dry["already"]) == (len(expected),) * 2 + (0,)
    text = await rs.relay(settings, "backfill", *window)
    assert text.code == 0, text.stderr
    shown = [line.strip() for line in text.stdout.splitlines() if line.startswith("  r1 ")]
    assert shown == [
        f"r1 {at:%Y-%m-%dT%H:%M:%SZ} (local {at:%Y-%m-%d %H:%M:%S}+00:00 UTC) webhook new"
        for at in before
    ] + [
        f"r1 {at:%Y-%m-%dT%H:%M:%SZ} (local "
        f"{at.astimezone(ZoneInfo('Europe/Berlin')).isoformat(sep=' ')} Europe/Berlin) "
        "webhook new"
        for at in after
    ]
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 0  # a dry run

    done = await _backfill(settings, *window, "--apply")
    assert done["occurrences"] == dry["occurrences"]  # the apply admits what the dry run said
    admitted = await pool.fetch(
        "SELECT occurrence_at, idempotency_key, state::text AS state FROM deliveries"
        " WHERE run_id = $1 ORDER BY 1",
        done["run_id"],
    )
    assert [(r["occurrence_at"], r["state"]) for r in admitted] == [
        (at, "pending") for at in expected
    ]
    assert [r["idempotency_key"] for r in admitted] == [
        admission.schedule_key("r1", at, "webhook") for at in expected
    ]
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == len(expected)
    again = await _backfill(settings, *window, "--apply")
    assert (again["new"], again["already"], again["occurrences"]) == (0, len(expected), [])


async def _backfill(settings: Settings, *args: str) -> dict:  # type: ignore[type-arg]
    result = await rs.relay(settings, "backfill", *args, "--json")
    assert result.code == 0, (result.stdout, result.stderr)
    data: dict = json.loads(result.stdout)  # type: ignore[type-arg]
    return data
