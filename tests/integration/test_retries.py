"""Retries through the delay tiers, dead letters, replay and rescue — real servers.

Time is compressed through configuration (delay tiers of 0.5-5 s, a 3 s lease), never
by sleeping for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import aio_pika
import asyncpg

from service import amqp, messages
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _delivered(pool: asyncpg.Pool, n: int) -> bool:
    return (await rs.states(pool)).get("delivered", 0) == n


async def _state_of(pool: asyncpg.Pool, reminder_id: str) -> str:
    return str(
        await pool.fetchval(
            "SELECT state::text FROM deliveries WHERE reminder_id = $1", reminder_id
        )
    )


@contextlib.asynccontextmanager
async def _queue(settings: Settings, name: str) -> AsyncIterator[aio_pika.abc.AbstractQueue]:
    """One of the test's queues, declared passively on a connection of its own."""
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        yield await channel.declare_queue(name, passive=True)


async def _dead_letters(settings: Settings) -> list[aio_pika.abc.AbstractIncomingMessage]:
    found = []
    async with _queue(settings, amqp.Topology.from_settings(settings).dead_queue) as queue:
        while (message := await queue.get(fail=False)) is not None:
            found.append(message)
        for message in found:
            await message.nack(requeue=True)
    return found


async def _purge(settings: Settings, lane: str = amqp.BULK) -> int:
    async with _queue(settings, amqp.Topology.from_settings(settings).lane_queue(lane)) as queue:
        result = await queue.purge()
        return int(result.message_count)


async def test_one_failing_endpoint_neither_delays_the_others_nor_duplicates(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    # However slow the machine: the victim must not exhaust its attempts before the endpoint
    # recovers, nor sit out a long circuit cool-down once the others are done; and a healthy
    # answer that a loaded machine delays past the suite's 2 s timeout must not count as the
    # victim's harm (it did, twice in a run with two suites on 2 cores: 16 second attempts).
    settings = settings.model_copy(
        update={
            "max_attempts": 50,
            "breaker_cooldown_seconds": 2.0,
            "http_timeout_seconds": 20.0,
            "lease_seconds": 30.0,
        }
    )
    # One endpoint answers 503 until the others are delivered and it has failed twice.
    partner.state.rules["down"] = partner_mod.PathRule(
        status=503, until_monotonic=time.monotonic() + 1000
    )
    # The victim is due (and queued) first, so its retries fall in the others' drain.
    victim_line = rs.line("victim", partner.url("down"), due_at=datetime.now(UTC))
    lines = [rs.line(f"b{i}", partner.url("healthy")) for i in range(1000)]
    await rs.load(pool, [victim_line, *lines])
    assert (await rs.relay(settings, "publish")).code == 0

    async def others_done_and_victim_failed_twice() -> bool:
        failed = await pool.fetchval(
            "SELECT count(*) FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id"
            " WHERE d.reminder_id = 'victim' AND a.outcome = 'retry'"
        )
        return failed >= 2 and await _delivered(pool, 1000)

    async with rs.consumer_in_process(settings):
        await rs.wait_for(others_done_and_victim_failed_twice, 60, "others delivered")
        partner.state.rules["down"].until_monotonic = time.monotonic()  # it recovers
        await rs.wait_for(lambda: _delivered(pool, 1001), 30, "victim delivered")

    # The others: each delivered at its first attempt, once, none held back by the victim.
    others = await pool.fetch(
        "SELECT d.attempts, a.started_at FROM deliveries d"
        " JOIN delivery_attempts a ON a.delivery_id = d.id WHERE d.reminder_id <> 'victim'"
    )
    assert len(others) == 1000 and {o["attempts"] for o in others} == {1}
    assert partner.state.duplicates == 0
    # The victim: its failed attempts recorded as retries, then one accepted attempt; one
    # logical event at the partner.
    victim = await pool.fetchrow("SELECT * FROM deliveries WHERE reminder_id = 'victim'")
    attempts = await pool.fetch(
        "SELECT outcome, started_at FROM delivery_attempts WHERE delivery_id = $1 ORDER BY attempt",
        victim["id"],
    )
    assert victim["attempts"] == len(attempts) >= 3
    assert [a["outcome"] for a in attempts] == ["retry"] * (len(attempts) - 1) + ["accepted"]
    assert partner.state.events[victim["idempotency_key"]] == 1
    # While the victim waited for its first retry, the others kept being sent.
    first, second = attempts[0]["started_at"], attempts[1]["started_at"]
    assert any(first < o["started_at"] < second for o in others)


async def test_429_with_retry_after_is_not_retried_before_that_many_seconds(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["busy"] = partner_mod.PathRule(status=429, retry_after="2", first_n=1)
    arrivals: list[float] = []
    partner.state.on_request = lambda name, key: arrivals.append(time.monotonic())
    await rs.load(pool, [rs.line("r1", partner.url("busy"))])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _delivered(pool, 1), 20, "delivered after the throttle")
    assert len(arrivals) == 2
    assert arrivals[1] - arrivals[0] >= 2.0, arrivals
    outcomes = await pool.fetch(
        "SELECT outcome, http_status FROM delivery_attempts ORDER BY attempt"
    )
    assert [(o["outcome"], o["http_status"]) for o in outcomes] == [
        ("throttled", 429),
        ("accepted", 200),
    ]


async def test_exhausted_attempts_end_dead_in_the_dlq_and_replay_delivers_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    settings = settings.model_copy(update={"max_attempts": 3})
    partner.state.rules["down"] = partner_mod.PathRule(status=503)
    await rs.load(pool, [rs.line("r1", partner.url("down"))])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _state_is(pool, "dead"), 30, "dead after 3 attempts")
    row = await pool.fetchrow("SELECT * FROM deliveries")
    assert (row["attempts"], row["last_status"]) == (3, 503)
    assert row["last_error"].startswith("attempts exhausted")
    dead = await _dead_letters(settings)
    assert len(dead) == 1
    assert messages.decode(dead[0].body).delivery_id == row["id"]
    assert str(dead[0].headers[amqp.REASON_HEADER]).startswith("attempts exhausted")
    assert dead[0].headers["x-relay-attempts"] == 3
    assert dead[0].headers["x-relay-last-status"] == 503

    # The partner recovers; the operator looks first (dry run changes nothing), then applies.
    del partner.state.rules["down"]
    dry = await rs.relay(settings, "replay")
    assert dry.code == 0 and "would replay=1" in dry.stdout and "dry run" in dry.stdout
    assert await _state_is(pool, "dead")
    applied = await rs.relay(settings, "replay", "--apply", "--operator", "test-op")
    assert applied.code == 0 and "replayed=1" in applied.stdout, applied.stdout + applied.stderr
    assert await _dead_letters(settings) == []
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _delivered(pool, 1), 20, "delivered after replay")
    row = await pool.fetchrow("SELECT * FROM deliveries")
    assert (row["attempts"], row["replays"], row["round_start"]) == (4, 1, 3)
    assert partner.state.logical_events == 1
    audit = await pool.fetchrow("SELECT * FROM replays")
    assert (audit["operator"], audit["replayed"], audit["source"]) == (
        "test-op",
        1,
        "dead-letter-queue",
    )
    # Replaying again is a no-op: the row is delivered.
    again = await rs.relay(settings, "replay", "--from", "ledger", "--apply")
    assert "replayed=0" in again.stdout


async def test_permanent_4xx_is_dead_at_once_without_retries(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["strict"] = partner_mod.PathRule(status=422)
    await rs.load(pool, [rs.line("r1", partner.url("strict"))])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _state_is(pool, "dead"), 20, "dead")
    row = await pool.fetchrow("SELECT * FROM deliveries")
    assert (row["attempts"], row["last_status"]) == (1, 422)
    assert partner.state.requests_by_path["strict"] == 1
    dead = await _dead_letters(settings)
    assert [str(m.headers[amqp.REASON_HEADER]) for m in dead] == ["rejected: http 422"]


async def test_purged_queue_with_deliveries_in_flight_is_recovered_from_the_ledger(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    # A small prefetch keeps most of the 500 waiting in the queue (ready, purgeable) for
    # seconds, whenever the purge lands: 20 sends at a time, 0.2 s each.
    settings = settings.model_copy(update={"prefetch": 20, "destination_max_share": 1.0})
    partner.state.rules["slowish"] = partner_mod.PathRule(delay_seconds=0.2)
    await rs.load(pool, [rs.line(f"r{i}", partner.url("slowish")) for i in range(500)])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _some_delivered(pool), 20, "deliveries in flight")
        purged = await _purge(settings)
    assert purged > 0
    # What the consumer held at the purge (prefetched, or claimed and given back as it
    # stopped) went back to the queue when it stopped: purged too, so that only the
    # ledger knows those rows (seen: 7 of 447 back in the queue).
    purged += await _purge(settings)
    states = await rs.states(pool)
    assert states.get("queued", 0) == purged  # their messages are gone: only the ledger knows

    result = await rs.relay(settings, "replay", "--from", "ledger", "--state", "queued", "--apply")
    assert result.code == 0 and f"replayed={purged}" in result.stdout, result.stdout
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _delivered(pool, 500), 60, "all 500 delivered")
    assert partner.state.logical_events == 500
    assert partner.state.duplicates == 0
    assert max(partner.state.events.values()) == 1


async def test_sending_row_whose_consumer_died_and_message_was_lost_is_rescued_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    assert (await rs.relay(settings, "publish")).code == 0
    crashing = await rs.start_consumer(settings, CRASH_AT="after_send")
    assert await asyncio.wait_for(crashing.wait(), 30) == -signal.SIGKILL
    assert await _purge(settings) == 1  # the redelivery is lost too
    assert await _state_is(pool, "sending")

    async def lease_expired() -> bool:
        return bool(await pool.fetchval("SELECT lease_expires_at < now() FROM deliveries"))

    await rs.wait_for(lease_expired, 10, "lease expiry")
    rescued = await rs.relay(settings, "rescue")
    assert rescued.code == 0 and "rescued=1" in rescued.stdout, rescued.stdout
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _delivered(pool, 1), 20, "rescued delivery delivered")
    row = await pool.fetchrow("SELECT * FROM deliveries")
    assert row["attempts"] == 2
    assert partner.state.logical_events == 1
    assert partner.state.events[row["idempotency_key"]] == 2  # resent with the same key
    runs = await pool.fetch("SELECT kind, rescued_count FROM publish_runs ORDER BY id")
    assert [(r["kind"], r["rescued_count"]) for r in runs] == [("publish", 0), ("rescue", 1)]


async def test_message_over_the_delivery_limit_is_dead_lettered_by_the_broker(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    settings = settings.model_copy(update={"amqp_delivery_limit": 2})
    await rs.load(pool, [rs.line("r1", partner.url())])
    assert (await rs.relay(settings, "publish", AMQP_DELIVERY_LIMIT="2")).code == 0
    # A consumer that crashes on this message every time (it requeues it unprocessed).
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            amqp.Topology.from_settings(settings).lane_queue(amqp.BULK), passive=True
        )
        for _ in range(3):
            message = await queue.get(timeout=5)
            await message.nack(requeue=True)
        assert await queue.get(fail=False) is None
    dead = await _dead_letters(settings)
    assert len(dead) == 1
    assert dead[0].headers["x-first-death-reason"] == "delivery_limit"


async def test_crash_at_each_step_of_the_retry_handoff_loses_nothing_and_sends_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    partner.state.rules["flaky"] = partner_mod.PathRule(status=503, first_n_per_key=1)
    await _one_crash_at_each(settings, pool, partner.url("flaky"), ["after_write", "after_publish"])
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _delivered(pool, 2), 30, "both delivered")
    assert partner.state.logical_events == 2
    assert partner.state.duplicates == 0
    assert partner.state.requests_by_path["flaky"] == 4  # two 503s, then one send each
    rows = await pool.fetch("SELECT attempts FROM deliveries")
    assert [r["attempts"] for r in rows] == [2, 2]


async def _one_crash_at_each(
    settings: Settings, pool: asyncpg.Pool, url: str, points: list[str]
) -> None:
    """One reminder per crash point, published; a consumer SIGKILLs itself at each point."""
    await rs.load(pool, [rs.line(p, url) for p in points])
    assert (await rs.relay(settings, "publish")).code == 0
    for point in points:
        crashing = await rs.start_consumer(settings, CRASH_AT=point, PREFETCH="1")
        assert await asyncio.wait_for(crashing.wait(), 30) == -signal.SIGKILL, point


async def _state_is(pool: asyncpg.Pool, state: str) -> bool:
    return set(await rs.states(pool)) == {state}


async def _some_delivered(pool: asyncpg.Pool) -> bool:
    return (await rs.states(pool)).get("delivered", 0) >= 20


async def test_crash_between_the_dead_write_and_the_dead_letter_still_dead_letters_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["rejecting"] = partner_mod.PathRule(status=400)
    # Before and after the dead-letter publish.
    await _one_crash_at_each(
        settings, pool, partner.url("rejecting"), ["after_write", "after_publish"]
    )
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _all_dead_lettered(pool), 30, "both dead letters recorded")
        await rs.wait_for(lambda: _queue_empty(settings), 30, "redeliveries settled")
    dead = await _dead_letters(settings)
    assert sorted(m.headers["x-relay-delivery-id"] for m in dead) == [1, 2]
    assert all(str(m.headers[amqp.REASON_HEADER]).startswith("rejected") for m in dead)
    assert partner.state.requests_by_path["rejecting"] == 2  # nothing was sent again
    rows = await pool.fetch("SELECT state::text, attempts FROM deliveries ORDER BY id")
    assert [(r["state"], r["attempts"]) for r in rows] == [("dead", 1), ("dead", 1)]


async def _all_dead_lettered(pool: asyncpg.Pool) -> bool:
    missing = await pool.fetchval(
        "SELECT count(*) FROM deliveries WHERE state <> 'dead' OR dead_lettered_at IS NULL"
    )
    return bool(missing == 0)


async def _queue_empty(settings: Settings) -> bool:
    lane = amqp.Topology.from_settings(settings).lane_queue(amqp.BULK)
    async with _queue(settings, lane) as queue:
        return queue.declaration_result.message_count == 0
