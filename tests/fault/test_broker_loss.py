"""A broker node SIGKILLed under a running publisher and a running consumer.

Each test starts its own throwaway RabbitMQ node (own ports and data directory) and kills
it by PID; the machine's shared broker is never touched. The ledger must make the loss
cost time only: every row is published and delivered after the node comes back, each
receiver sees one logical event per delivery.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs
from tests.support.nodes import RabbitNode
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]


async def _count(pool: asyncpg.Pool, state: str) -> int:
    return (await rs.states(pool)).get(state, 0)


async def test_broker_killed_during_a_publish_run_leaves_the_rest_pending_for_the_next(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, rabbit: RabbitNode
) -> None:
    settings = settings.model_copy(update={"amqp_url": rabbit.url, "publish_batch_size": 200})
    past = datetime.now(UTC) - timedelta(seconds=5)
    await rs.load(pool, [rs.line(f"r{i}", partner.url(), due_at=past) for i in range(20000)])

    run = asyncio.create_task(rs.relay(settings, "publish", timeout=120))

    async def some_queued() -> bool:
        return await _count(pool, "queued") >= 1000

    await rs.wait_for(some_queued, 60, "publishing under way", interval=0.1)
    await asyncio.to_thread(rabbit.kill)
    failed = await run
    assert failed.code != 0, failed.stdout
    queued_before = await _count(pool, "queued")
    assert 1000 <= queued_before < 20000
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 20000  # all admitted

    await asyncio.to_thread(rabbit.restart)
    again = await rs.relay(settings, "publish", timeout=120)
    assert again.code == 0, again.stdout + again.stderr[-2000:]
    assert await _count(pool, "queued") == 20000
    runs = await pool.fetch("SELECT status FROM publish_runs ORDER BY id")
    assert [r["status"] for r in runs] == ["incomplete", "ok"]


async def test_consumer_exits_when_its_broker_dies_and_a_restart_loses_nothing(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, rabbit: RabbitNode
) -> None:
    settings = settings.model_copy(update={"amqp_url": rabbit.url})
    partner.state.rules["slow"] = partner_mod.PathRule(delay_seconds=0.05)
    await rs.load(pool, [rs.line(f"r{i}", partner.url("slow")) for i in range(600)])
    assert (await rs.relay(settings, "publish")).code == 0

    # Its only node stays down: it reconnects with backoff for 10 s, then exits.
    consumer = await rs.start_consumer(settings, PREFETCH="20", BROKER_OUTAGE_MAX_SECONDS="10")

    async def some_delivered() -> bool:
        return await _count(pool, "delivered") >= 50

    await rs.wait_for(some_delivered, 60, "deliveries under way")
    await asyncio.to_thread(rabbit.kill)
    # Its only node is gone: reconnects fail for RELAY_BROKER_OUTAGE_MAX_SECONDS, then it
    # exits UNAVAILABLE and leaves recovery to a restart (with several nodes it reconnects
    # to another: issue 19; a node back within the bound: tests/fault/test_broker_restart.py).
    assert await asyncio.wait_for(consumer.wait(), 60) == 3
    assert await _count(pool, "delivered") < 600

    await asyncio.to_thread(rabbit.restart)
    consumer = await rs.start_consumer(settings)
    try:

        async def all_delivered() -> bool:
            return await _count(pool, "delivered") == 600

        await rs.wait_for(all_delivered, 120, "all 600 delivered after the restart")
    finally:
        assert await rs.stop(consumer) == 0
    assert partner.state.logical_events == 600
    assert max(partner.state.events.values()) <= 2  # a resend uses the same key
