"""The core pipeline against real PostgreSQL, RabbitMQ and HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import aio_pika
import asyncpg
import pytest

from service import amqp, messages
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _deliveries(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT * FROM deliveries ORDER BY id")


async def test_publish_creates_one_row_per_owed_occurrence_and_a_rerun_adds_none(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    past = datetime.now(UTC) - timedelta(minutes=1)
    future = datetime.now(UTC) + timedelta(days=1)
    lines = [rs.line(f"r{i}", partner.url(), due_at=past) for i in range(30)]
    lines += [rs.line(f"later{i}", partner.url(), due_at=future) for i in range(5)]
    await rs.load(pool, lines)

    first = await rs.relay(settings, "publish")
    assert first.code == 0, first.stderr
    second = await rs.relay(settings, "publish")
    assert second.code == 0, second.stderr

    rows = await _deliveries(pool)
    assert sorted(r["reminder_id"] for r in rows) == sorted(f"r{i}" for i in range(30))
    assert {r["state"] for r in rows} == {"queued"}
    assert all(r["published_at"] is not None for r in rows)
    runs = await pool.fetch("SELECT * FROM publish_runs ORDER BY id")
    assert [(r["status"], r["created_count"], r["published_count"]) for r in runs] == [
        ("ok", 30, 30),
        ("ok", 0, 0),
    ]
    # One message per row in the bulk lane, each carrying only the id.
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            amqp.Topology.from_settings(settings).lane_queue(amqp.BULK), passive=True
        )
        assert queue.declaration_result.message_count == 30
        message = await queue.get()
        assert message is not None
        assert set(json.loads(message.body)) == {"v", "delivery_id"}
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.content_type == "application/json"
        assert "traceparent" in message.headers  # the run's trace
        await message.nack(requeue=True)


async def test_two_publish_runs_at_once_over_5000_reminders_create_each_row_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    past = datetime.now(UTC) - timedelta(seconds=5)
    await rs.load(pool, [rs.line(f"r{i}", partner.url(), due_at=past) for i in range(5000)])

    # Another admission holds 100 of the due reminders locked throughout (as a third run
    # in the middle of a batch would): the runs must skip them, never wait for them.
    async with pool.acquire() as holder, holder.transaction():
        held = await holder.fetch(
            "SELECT id FROM reminders WHERE id IN"
            " (SELECT id FROM reminders ORDER BY next_due_at LIMIT 100) FOR UPDATE"
        )
        a, b = await asyncio.gather(
            rs.relay(settings, "publish", timeout=60, PUBLISH_BATCH_SIZE="200"),
            rs.relay(settings, "publish", timeout=60, PUBLISH_BATCH_SIZE="200"),
        )
    assert (a.code, b.code) == (0, 0), (a.stderr[-2000:], b.stderr[-2000:])
    assert len(held) == 100
    counts = await pool.fetchrow(
        "SELECT count(*) AS n, count(DISTINCT reminder_id) AS reminders,"
        " count(*) FILTER (WHERE state = 'queued') AS queued,"
        " count(*) FILTER (WHERE reminder_id = ANY($1::text[])) AS held FROM deliveries",
        [r["id"] for r in held],
    )
    assert (counts["n"], counts["reminders"], counts["queued"]) == (4900, 4900, 4900)
    assert counts["held"] == 0
    assert await pool.fetchval("SELECT sum(created_count) FROM publish_runs") == 4900

    # Released, the held reminders are admitted by the next run, once.
    again = await rs.relay(settings, "publish")
    assert again.code == 0, again.stderr
    assert await pool.fetchval("SELECT count(DISTINCT reminder_id) FROM deliveries") == 5000
    runs = await pool.fetch("SELECT created_count FROM publish_runs ORDER BY id")
    assert [r["created_count"] for r in runs][-1] == 100 and len(runs) == 3


async def test_unreachable_broker_fails_the_run_and_leaves_rows_pending_for_the_next(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"r{i}", partner.url()) for i in range(10)])

    failed = await rs.relay(settings, "publish", AMQP_URL="amqp://guest:guest@127.0.0.1:1/")
    assert failed.code == 3, failed.stdout + failed.stderr
    assert {r["state"] for r in await _deliveries(pool)} == {"pending"}
    run = await pool.fetchrow("SELECT * FROM publish_runs")
    assert (run["status"], run["created_count"], run["failed_count"]) == ("incomplete", 10, 10)

    again = await rs.relay(settings, "publish")
    assert again.code == 0, again.stderr
    assert {r["state"] for r in await _deliveries(pool)} == {"queued"}


async def test_messages_the_broker_cannot_route_leave_their_rows_pending_for_the_next_run(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"r{i}", partner.url()) for i in range(20)])
    topology = amqp.Topology.from_settings(settings)
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        # The run declares the topology first, then admits: hold admission back, and take
        # the bulk lane's binding away once the run has declared it.
        async with pool.acquire() as holder, holder.transaction():
            await holder.execute("LOCK TABLE deliveries IN EXCLUSIVE MODE")
            run = asyncio.create_task(rs.relay(settings, "publish"))
            await rs.wait_for(lambda: rs.waiting_on_a_lock(pool), 30, "the run's admission waiting")
            lane = await channel.get_queue(topology.lane_queue(amqp.BULK), ensure=False)
            await lane.unbind(topology.work_exchange, amqp.BULK)
        unroutable = await run
        assert unroutable.code == 1, unroutable.stdout + unroutable.stderr
        assert {r["state"] for r in await _deliveries(pool)} == {"pending"}
        record = await pool.fetchrow("SELECT * FROM publish_runs")
        assert (record["status"], record["published_count"], record["failed_count"]) == (
            "incomplete",
            0,
            20,
        )
        lane = await channel.declare_queue(lane.name, passive=True)
        assert lane.declaration_result.message_count == 0

    again = await rs.relay(settings, "publish")  # declares the binding again
    assert again.code == 0, again.stderr
    assert {r["state"] for r in await _deliveries(pool)} == {"queued"}


async def test_published_deliveries_are_delivered_once_with_the_ledger_key(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"r{i}", partner.url()) for i in range(50)])
    assert (await rs.relay(settings, "publish")).code == 0

    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _all_in(pool, "delivered"), 30, "every delivery delivered")
    rows = await _deliveries(pool)
    assert {r["idempotency_key"] for r in rows} == set(partner.state.accepted)
    assert partner.state.duplicates == 0
    assert all(r["attempts"] == 1 and r["receipt"] for r in rows)
    attempts = await pool.fetch("SELECT * FROM delivery_attempts")
    assert len(attempts) == 50 and {a["outcome"] for a in attempts} == {"accepted"}
    assert partner.state.bad_signatures == 0


async def test_redelivered_message_for_delivered_row_is_acked_without_sending(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings) as consumer:
        await rs.wait_for(lambda: _all_in(pool, "delivered"), 20, "delivered")
        delivery_id = await pool.fetchval("SELECT id FROM deliveries")
        await _publish_raw(settings, messages.encode(delivery_id))
        await _publish_raw(settings, messages.encode(delivery_id))

        async def two_duplicate_hits() -> bool:
            return consumer.metric("relay.delivery.duplicates", state="delivered") == 2

        await rs.wait_for(two_duplicate_hits, 20, "two duplicate hits counted")
    assert sum(partner.state.requests_by_path.values()) == 1
    row = await pool.fetchrow("SELECT state, attempts FROM deliveries")
    assert (row["state"], row["attempts"]) == ("delivered", 1)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xff\xfe not json", "undecodable body"),
        (b'{"v": 2, "delivery_id": 1}', "unsupported schema version"),
        (b'{"v": 1, "delivery_id": "x"}', "invalid message"),
        (b'{"v": 1, "delivery_id": 99999}', "unknown delivery id"),
    ],
)
async def test_poison_message_is_dead_lettered_with_reason_and_consumer_keeps_going(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, body: bytes, reason: str
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    async with rs.consumer_in_process(settings):
        await _publish_raw(settings, body)
        assert (await rs.relay(settings, "publish")).code == 0
        await rs.wait_for(lambda: _all_in(pool, "delivered"), 20, "good one delivered")
        dead = await _get_dead(settings)
    assert dead is not None
    assert dead.body == body
    assert str(dead.headers[amqp.REASON_HEADER]).startswith(reason)


async def _all_in(pool: asyncpg.Pool, state: str) -> bool:
    counts = await rs.states(pool)
    return bool(counts) and set(counts) == {state}


async def _publish_raw(settings: Settings, body: bytes) -> None:
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        # A message the exchange cannot route raises here instead of vanishing.
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(amqp.Topology.from_settings(settings).work_exchange)
        await exchange.publish(aio_pika.Message(body), amqp.BULK, mandatory=True)


async def _get_dead(settings: Settings) -> aio_pika.abc.AbstractIncomingMessage | None:
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            amqp.Topology.from_settings(settings).dead_queue, passive=True
        )
        for _ in range(50):
            message = await queue.get(fail=False)
            if message is not None:
                await message.ack()
                return message
            await asyncio.sleep(0.1)
    return None
