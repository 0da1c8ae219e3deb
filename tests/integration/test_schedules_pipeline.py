"""Schedules through the real pipeline: missed-run policies, staleness, cancellation and
payload changes after a delivery was queued, overlapping publish runs, pause/resume and
the reminder management commands — real PostgreSQL, RabbitMQ, HTTP and ``relay`` CLI."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import pytest
from aiohttp import web

from service import schedule
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner

pytestmark = pytest.mark.timeout(60)


async def _one(pool: asyncpg.Pool, sql: str, *args: object) -> asyncpg.Record:
    row = await pool.fetchrow(sql, *args)
    assert row is not None, sql
    return row


BERLIN = "Europe/Berlin"


@dataclass
class RecordingReceiver:
    """A webhook receiver that keeps every request body (the demo partner keeps keys only)."""

    port: int = 0
    bodies: list[tuple[str, Any]] = field(default_factory=list)  # (Idempotency-Key, JSON body)

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append((request.headers.get("Idempotency-Key", ""), await request.json()))
        return web.json_response({"ok": True})


@pytest.fixture
async def receiver() -> AsyncIterator[RecordingReceiver]:
    recorder = RecordingReceiver()
    app = web.Application()
    app.router.add_post("/hook", recorder.handle)
    runner, recorder.port = await partner_mod.serve(app)
    yield recorder
    await runner.cleanup()


async def _publish(settings: Settings) -> None:
    result = await rs.relay(settings, "publish")
    assert result.code == 0, result.stderr[-2000:]


async def _delivery(pool: asyncpg.Pool, reminder_id: str) -> asyncpg.Record:
    return await _one(pool, "SELECT * FROM deliveries WHERE reminder_id = $1", reminder_id)


async def _all_final(pool: asyncpg.Pool) -> bool:
    counts = await rs.states(pool)
    return bool(counts) and set(counts) <= {"delivered", "skipped", "dead"}


# ---------------------------------------------------------------- (a) missed runs


async def test_publisher_down_three_days_follows_each_reminders_missed_policy(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    now = datetime.now(UTC)
    # Daily two hours before now (Berlin wall time): no occurrence is near `now`, so the
    # test's view and the publish run's view of what is owed cannot differ, and none of
    # the owed occurrences is within the misfire grace (300 s).
    daily_at = (now - timedelta(hours=2)).astimezone(ZoneInfo(BERLIN)).strftime("%H:%M")
    sched = schedule.Schedule(
        kind="daily", timezone=BERLIN, daily_at=schedule.parse_daily_at(daily_at)
    )
    policies = ("catch_up", "latest", "skip")
    await rs.load(
        pool,
        [
            rs.line(
                f"daily-{p}", partner.url(), daily_at=daily_at, timezone=BERLIN, missed_policy=p
            )
            for p in policies
        ],
    )
    # The publisher last ran three days ago: the stored next occurrence is 3 days back.
    three_days_back = schedule.occurrences(sched, now - timedelta(days=3, hours=3), now, 1)[0]
    await pool.execute("UPDATE reminders SET next_due_at = $1", three_days_back)
    owed = schedule.occurrences(sched, three_days_back, now, 100)
    assert len(owed) in (3, 4) and all(now - at > timedelta(minutes=10) for at in owed)

    await _publish(settings)

    rows = await pool.fetch(
        "SELECT reminder_id, occurrence_at, state::text AS state, skip_reason FROM deliveries"
        " ORDER BY reminder_id, occurrence_at"
    )
    got = {
        p: [
            (r["occurrence_at"], r["state"], r["skip_reason"])
            for r in rows
            if r["reminder_id"] == f"daily-{p}"
        ]
        for p in policies
    }
    assert got["catch_up"] == [(at, "queued", None) for at in owed]
    assert got["latest"] == [(at, "skipped", "missed") for at in owed[:-1]] + [
        (owed[-1], "queued", None)
    ]
    assert got["skip"] == [(at, "skipped", "missed") for at in owed]
    nexts = await pool.fetch("SELECT next_due_at FROM reminders")
    expected_next = schedule.next_occurrence_after(sched, now)
    assert expected_next is not None and expected_next > datetime.now(UTC)
    assert {r["next_due_at"] for r in nexts} == {expected_next}
    run = await _one(pool, "SELECT * FROM publish_runs")
    n = len(owed)
    assert (run["status"], run["due_count"], run["created_count"]) == ("ok", 3 * n, 3 * n)
    assert (run["skipped_count"], run["published_count"]) == (2 * n - 1, n + 1)


# ---------------------------------------------------------------- (b) stale_after


async def test_stale_occurrence_is_skipped_at_send_time_unless_send_stale(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    ten_minutes_ago = datetime.now(UTC) - timedelta(minutes=10)
    await rs.load(
        pool,
        [
            rs.line("stale-skip", partner.url("stale"), due_at=ten_minutes_ago, stale_after=60),
            rs.line(
                "stale-send",
                partner.url("stale"),
                due_at=ten_minutes_ago,
                stale_after=60,
                send_stale=True,
            ),
        ],
    )
    await _publish(settings)
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _all_final(pool), 20, "both deliveries final")

    skipped = await _delivery(pool, "stale-skip")
    assert (skipped["state"], skipped["skip_reason"]) == ("skipped", "stale")
    sent = await _delivery(pool, "stale-send")
    assert sent["state"] == "delivered"
    assert partner.state.events == {sent["idempotency_key"]: 1}  # the stale-skip never sent
    outcomes = await pool.fetch(
        "SELECT delivery_id, outcome, error FROM delivery_attempts ORDER BY delivery_id"
    )
    assert {(o["delivery_id"], o["outcome"], o["error"]) for o in outcomes} == {
        (skipped["id"], "skipped", "stale"),
        (sent["id"], "accepted", None),
    }


# ---------------------------------------------------------------- (c) cancel after queued


async def test_reminder_cancelled_after_its_delivery_was_queued_is_skipped_not_sent(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    await _publish(settings)
    assert (await _delivery(pool, "r1"))["state"] == "queued"

    cancelled = await rs.relay(settings, "reminders", "cancel", "r1")
    assert cancelled.code == 0, cancelled.stderr

    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _all_final(pool), 20, "the delivery final")
    row = await _delivery(pool, "r1")
    assert (row["state"], row["skip_reason"]) == ("skipped", "cancelled")
    assert sum(partner.state.requests_by_path.values()) == 0
    attempt = await _one(pool, "SELECT outcome, error FROM delivery_attempts")
    assert (attempt["outcome"], attempt["error"]) == ("skipped", "cancelled")


# ---------------------------------------------------------------- (d) payload updated


async def test_payload_updated_after_queued_sends_the_new_payload_and_records_version_2(
    settings: Settings, pool: asyncpg.Pool, receiver: RecordingReceiver
) -> None:
    due = datetime.now(UTC) - timedelta(minutes=1)
    await rs.load(pool, [rs.line("r1", receiver.url(), due_at=due, payload={"text": "old"})])
    await _publish(settings)
    assert (await _delivery(pool, "r1"))["state"] == "queued"

    # Re-load with the same schedule and a new payload: a new version, and no re-fire.
    await rs.load(pool, [rs.line("r1", receiver.url(), due_at=due, payload={"text": "new"})])
    reminder = await _one(pool, "SELECT payload_version, next_due_at FROM reminders")
    assert (reminder["payload_version"], reminder["next_due_at"]) == (2, None)
    await _publish(settings)

    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _all_final(pool), 20, "the delivery final")
    row = await _delivery(pool, "r1")
    assert row["state"] == "delivered"
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 1
    assert receiver.bodies == [(row["idempotency_key"], {"text": "new"})]
    attempt = await _one(pool, "SELECT outcome, payload_version FROM delivery_attempts")
    assert (attempt["outcome"], attempt["payload_version"]) == ("accepted", 2)


# ---------------------------------------------------------------- (e) overlapping runs


async def test_two_publish_runs_at_once_over_10000_due_reminders_admit_each_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    past = datetime.now(UTC) - timedelta(seconds=5)
    await rs.load(pool, [rs.line(f"r{i}", partner.url(), due_at=past) for i in range(10_000)])

    # A batch's worth of the due reminders stays locked by another admission (as a third
    # run's batch would be) while both run: they skip it rather than wait for it, so
    # neither run can be held up by another's locks.
    async with pool.acquire() as holder, holder.transaction():
        held = await holder.fetch(
            "SELECT id FROM reminders WHERE id IN"
            " (SELECT id FROM reminders ORDER BY id OFFSET 5000 LIMIT 200) FOR UPDATE"
        )
        a, b = await asyncio.gather(
            rs.relay(settings, "publish", timeout=50, PUBLISH_BATCH_SIZE="200"),
            rs.relay(settings, "publish", timeout=50, PUBLISH_BATCH_SIZE="200"),
        )
    assert (a.code, b.code) == (0, 0), (a.stderr[-2000:], b.stderr[-2000:])
    assert len(held) == 200
    counts = await _one(
        pool,
        "SELECT count(*) AS n, count(DISTINCT reminder_id) AS reminders,"
        " count(*) FILTER (WHERE state = 'queued') AS queued FROM deliveries",
    )
    assert (counts["n"], counts["reminders"], counts["queued"]) == (9_800, 9_800, 9_800)
    still_due = "SELECT count(*) FROM reminders WHERE next_due_at IS NOT NULL"
    assert await pool.fetchval(still_due) == 200
    runs = await pool.fetch("SELECT status, created_count FROM publish_runs ORDER BY id")
    assert [r["status"] for r in runs] == ["ok", "ok"]
    assert sum(r["created_count"] for r in runs) == 9_800

    # Released, the locked ones are admitted by the next run, once.
    assert (await rs.relay(settings, "publish")).code == 0
    assert await pool.fetchval("SELECT count(DISTINCT reminder_id) FROM deliveries") == 10_000
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 10_000
    assert await pool.fetchval(still_due) == 0


# ---------------------------------------------------------------- (f) pause / resume


async def test_paused_run_is_recorded_and_admits_nothing_until_resumed(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    due_before = await pool.fetchval("SELECT next_due_at FROM reminders")

    paused = await rs.relay(settings, "pause")
    assert paused.code == 0, paused.stderr
    await _publish(settings)
    run = await _one(pool, "SELECT * FROM publish_runs")
    assert (run["status"], run["due_count"], run["created_count"]) == ("paused", 0, 0)
    assert run["finished_at"] is not None
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 0
    assert await pool.fetchval("SELECT next_due_at FROM reminders") == due_before

    resumed = await rs.relay(settings, "resume")
    assert resumed.code == 0, resumed.stderr
    await _publish(settings)
    runs = await pool.fetch("SELECT status, created_count FROM publish_runs ORDER BY id")
    assert [(r["status"], r["created_count"]) for r in runs] == [("paused", 0), ("ok", 1)]
    assert (await _delivery(pool, "r1"))["state"] == "queued"


# ---------------------------------------------------------------- (g) management commands


async def _load_one_of_each_kind(pool: asyncpg.Pool, url: str) -> None:
    await rs.load(
        pool,
        [
            rs.line("clinic-daily", url, daily_at="06:00", timezone=BERLIN),
            rs.line("invoice-7", url, due_at=datetime.now(UTC) + timedelta(days=1)),
            rs.line("weekly-cron", url, cron="30 7 * * 1", timezone=BERLIN),
        ],
    )


async def test_reminders_list_prints_every_kind_of_reminder(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await _load_one_of_each_kind(pool, partner.url())

    listed = await rs.relay(settings, "reminders", "list")
    assert listed.code == 0, listed.stderr[-2000:]
    lines = listed.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == ["clinic-daily", "invoice-7", "weekly-cron"]
    assert "daily 06:00" in lines[1] and "once" in lines[2] and "cron 30 7 * * 1" in lines[3]


async def test_reminders_show_prints_next_occurrences_in_local_time_and_utc_and_cancel_works(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await _load_one_of_each_kind(pool, partner.url())

    shown = await rs.relay(settings, "reminders", "show", "clinic-daily")
    assert shown.code == 0, shown.stderr
    next_due = await pool.fetchval("SELECT next_due_at FROM reminders WHERE id = 'clinic-daily'")
    sched = schedule.Schedule(
        kind="daily", timezone=BERLIN, daily_at=schedule.parse_daily_at("06:00")
    )
    upcoming = schedule.occurrences(sched, next_due, next_due + timedelta(days=30), 5)
    assert len(upcoming) == 5
    zone = ZoneInfo(BERLIN)
    for at in upcoming:
        local = at.astimezone(zone)
        assert local.strftime("%H:%M") == "06:00"
        expected = f"{local:%Y-%m-%d %H:%M %Z} ({BERLIN})  = {at:%Y-%m-%d %H:%M} UTC"
        assert expected in shown.stdout, shown.stdout

    cancelled = await rs.relay(settings, "reminders", "cancel", "clinic-daily")
    assert cancelled.code == 0, cancelled.stderr
    assert await pool.fetchval("SELECT active FROM reminders WHERE id = 'clinic-daily'") is False
    after = await rs.relay(settings, "reminders", "show", "clinic-daily")
    assert after.code == 0 and "next occurrences: none" in after.stdout

    unknown = await rs.relay(settings, "reminders", "cancel", "no-such-reminder")
    assert unknown.code == 1
    assert "no-such-reminder" in unknown.stderr
    assert (await rs.relay(settings, "reminders", "show", "no-such-reminder")).code == 1
