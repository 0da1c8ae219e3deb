"""On time: a publish run admits what falls due within its look-ahead, and each delivery
becomes deliverable at its due time — never before, whatever copy of its message arrives
early. Real PostgreSQL, RabbitMQ and HTTP on 127.0.0.1; facts, not timings: the ledger
records when each request went out (``delivery_attempts.started_at``) and when each
occurrence was due, both on clocks this machine shares.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from service import amqp, messages
from service.settings import Settings
from tests.support import broker
from tests.support import relay as rs
from tests.support.relay import RunningPartner

pytestmark = pytest.mark.timeout(90)


async def _rows(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return list(
        await pool.fetch(
            "SELECT d.id, d.reminder_id, d.state::text AS state, d.skip_reason,"
            " d.occurrence_at, a.started_at"
            " FROM deliveries AS d LEFT JOIN delivery_attempts AS a ON a.delivery_id = d.id"
            " ORDER BY d.id"
        )
    )


async def test_a_delivery_admitted_ahead_is_sent_at_its_due_time_not_before_even_when_a_copy_arrives_early(  # noqa: E501
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    due = datetime.now(UTC) + timedelta(seconds=6)
    await rs.load(pool, [rs.line(f"r{i}", partner.url(), due_at=due) for i in range(3)])
    published = await rs.relay(settings, "publish")
    assert published.code == 0, published.stderr
    # Admitted ahead of time: queued, its message waiting in the timer ladder.
    assert {r["state"] for r in await _rows(pool)} == {"queued"}
    topology = amqp.Topology.from_settings(settings)
    assert await broker.count(settings, topology.timer_queues) == 3
    # A copy of one message reaches its lane at once (a rescue, an operator's replay).
    first = (await _rows(pool))[0]["id"]
    await broker.publish_raw(settings, [messages.encode(first)])

    async def all_delivered() -> bool:
        return (await rs.states(pool)) == {"delivered": 3}

    async with rs.consumer_in_process(settings):
        await rs.wait_for(all_delivered, 40, "every delivery sent when due")
    rows = await _rows(pool)
    assert len(rows) == 3  # one attempt each: the early copy counted none
    for row in rows:
        assert row["started_at"] >= row["occurrence_at"], dict(row)
    assert partner.state.logical_events == 3 and partner.state.duplicates == 0
    # The run's report says how late its deliveries were, from the ledger's own times.
    status = await rs.relay(settings, "status", "--json")
    assert status.code == 0, status.stderr
    (run,) = json.loads(status.stdout)["runs"]
    latest = max(r["finished_at"] - r["occurrence_at"] for r in await pool.fetch(
        "SELECT finished_at, occurrence_at FROM deliveries"))  # fmt: skip
    assert run["lateness_max_seconds"] == pytest.approx(latest.total_seconds())
    assert 0 <= run["lateness_p50_seconds"] <= run["lateness_p95_seconds"] <= latest.total_seconds()


async def test_a_cancel_after_admission_ahead_and_before_the_due_time_means_no_request(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    due = datetime.now(UTC) + timedelta(seconds=5)
    await rs.load(pool, [rs.line("soon", partner.url(), due_at=due)])
    assert (await rs.relay(settings, "publish")).code == 0
    assert (await rs.states(pool)) == {"queued": 1}
    cancelled = await rs.relay(settings, "reminders", "cancel", "soon")
    assert cancelled.code == 0, cancelled.stderr

    async def skipped() -> bool:
        return (await rs.states(pool)) == {"skipped": 1}

    async with rs.consumer_in_process(settings):
        await rs.wait_for(skipped, 40, "the cancelled delivery skipped when due")
    (row,) = await _rows(pool)
    assert row["skip_reason"] == "cancelled"
    assert sum(partner.state.requests_by_path.values()) == 0


async def test_two_publish_runs_with_overlapping_windows_admit_each_occurrence_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    # Every minute, for 20 reminders: a 75 s look-ahead holds one or two occurrences each.
    await rs.load(pool, [rs.line(f"m{i}", partner.url(), cron="* * * * *") for i in range(20)])
    runs = await asyncio.gather(*(rs.relay(settings, "publish") for _ in range(2)))
    assert [r.code for r in runs] == [0, 0], [r.stderr for r in runs]
    again = await rs.relay(settings, "publish")  # a run one moment later: windows overlap
    assert again.code == 0
    keys = await pool.fetch(
        "SELECT reminder_id, occurrence_at, count(*) AS n FROM deliveries"
        " GROUP BY reminder_id, occurrence_at"
    )
    assert keys and all(k["n"] == 1 for k in keys)
    horizon = datetime.now(UTC) + timedelta(seconds=settings.publish_lookahead_seconds)
    per_reminder = await pool.fetch(
        "SELECT reminder_id, array_agg(occurrence_at ORDER BY occurrence_at) AS at"
        " FROM deliveries GROUP BY reminder_id"
    )
    assert len(per_reminder) == 20
    for row in per_reminder:
        minutes = row["at"]
        # Consecutive minutes, none beyond the last run's horizon, none left out.
        assert all(b - a == timedelta(minutes=1) for a, b in itertools.pairwise(minutes))
        assert minutes[-1] <= horizon
        assert minutes[-1] > horizon - timedelta(minutes=1) - timedelta(seconds=30)
