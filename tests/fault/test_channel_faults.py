"""RabbitMQ closes a consumer's channel, or cancels its consumer, while the connection
stays up (issue 12, "a closed consumer or publisher channel is noticed").

Each test runs a drain (two supervised ``relay consume`` processes, a ``relay publish``
run every 3 s) on a PostgreSQL cluster of its own and the module's RabbitMQ node, in a
namespace of its own (one node boot, ~5 CPU-s, for the module instead of one per test).
The consumer whose channel the server closed or whose consumer it cancelled must notice,
hand its messages back and connect again in the same process (issue 19: a broker failure
costs a reconnect, not a restart); nothing is lost and the partner sees one logical event
per key.

How the server is made to close exactly one consumer's channel (RabbitMQ 3.10): the
``consumer_timeout`` is read when a channel opens, and checked on every channel tick.
The node runs with a 0.5 s tick (``channel_tick_interval``); the timeout is set to 1 s
just while the second consumer opens its channels, then restored. That consumer's
consume channel alone is closed by the server (``PRECONDITION_FAILED - delivery
acknowledgement on channel N timed out``) as soon as it holds a delivery for over 1 s,
which every delivery here does (the partner answers after 2.5 s). The timeout is
restored as soon as that consumer is seen consuming; a session it opens again before
that may be closed again, one opened after it is left alone, and the first consumer's
channels (opened with the default, 30 min) are never closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path

import aio_pika
import pytest

from tests.support import relay as rs
from tests.support.fleet import Facts, Fleet, Slot, drain_settings, eventually, start_drain
from tests.support.nodes import NodeError, PostgresNode, RabbitNode
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

ROWS = 2000
CHANNEL_CLOSED = "delivery acknowledgement on channel"


def _reconnected(slot: Slot) -> Callable[[], Awaitable[bool]]:
    """Whether the slot's consumer ended a session on a broker failure and connects again."""
    return lambda: rs.logged(slot.log, "broker_reconnect")


async def _delete_queue(url: str, queue: str) -> int:
    """``queue.delete`` over AMQP: what ``rabbitmqctl delete_queue`` does (its consumers
    cancelled, its messages dropped) without starting an Erlang CLI, which took 7 s on a
    loaded machine, time enough for the drain to end and leave nothing to rescue. Returns
    the messages dropped."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        deleted = await channel.queue_delete(queue)
        return int(deleted.message_count or 0)


def _server_closed_channels(rabbit: RabbitNode) -> list[float]:
    """When the node closed a channel for a consumer timeout (monotonic seconds), from the
    timestamps of its own log lines (``2026-12-01 06:05:03.381922+00:00 [error] ...``)."""
    if not rabbit.log_file.exists():
        return []
    text = rabbit.log_file.read_text(errors="replace")
    offset = time.time() - time.monotonic()
    return [
        datetime.fromisoformat(line.split(" [", 1)[0]).timestamp() - offset
        for line in text.splitlines()
        if CHANNEL_CLOSED in line and "[error]" in line
    ]


async def test_consumer_channel_closed_by_the_server_is_noticed_and_nothing_is_lost(
    pg: PostgresNode, module_rabbit: RabbitNode, partner: RunningPartner, tmp_path: Path
) -> None:
    rabbit = module_rabbit
    assert partner.state.verify_secret is not None
    settings = drain_settings(
        database_url=pg.url,
        amqp_url=rabbit.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
    )
    fleet = Fleet(settings, partner, tmp_path / "logs", broker=rabbit)
    try:
        await fleet.prepare(ROWS)
        await asyncio.to_thread(rabbit.set_env, "channel_tick_interval", 500)
        # The first drains slowly (20 at a time: 8 a second), so messages are still queued
        # for the second, however long the rabbitmqctl calls below take on a loaded machine
        # (seen: 60 s, by which time a first at full prefetch had drained all 2,000).
        (first,) = await fleet.start_consumers(1, prefetch="20")
        assert await fleet.supervisor.wait_ready(first), "first consumer never ready"
        bulk = f"{fleet.namespace}.deliveries"
        firsts = await asyncio.to_thread(rabbit.consumer_channels, bulk)
        default_timeout = await asyncio.to_thread(rabbit.get_env, "consumer_timeout")
        await asyncio.to_thread(rabbit.set_env, "consumer_timeout", 1000)
        try:
            # Held: its replacement must not open channels before the timeout is restored.
            (second,) = await fleet.start_consumers(1, hold_restarts=True)

            async def second_consuming() -> bool:
                # Its channel may be opened and closed again between two looks, or during
                # one: the node's log, read again after the rabbitmqctl run, says so.
                if await asyncio.to_thread(_server_closed_channels, rabbit):
                    return True
                try:
                    if await asyncio.to_thread(rabbit.consumer_channels, bulk) - firsts:
                        return True
                except NodeError:
                    pass  # a CLI run that failed or timed out: the log still tells
                return bool(await asyncio.to_thread(_server_closed_channels, rabbit))

            # Restored as soon as its consume channel exists: a restart of it (after the
            # close, exit and restart delay) must get the default timeout.
            # 60 s: each look is a rabbitmqctl run, seconds apiece with two suites at once
            # (seen: one run outlasting the whole 60 s on a slow VM, hence the second
            # reading of the log after it).
            assert await eventually(second_consuming, 60), "second consumer never consumed"
        finally:
            await asyncio.to_thread(rabbit.set_env, "consumer_timeout", default_timeout)
        second.restarts_allowed.set()
        restored = fleet.note("second consumer's channel opened with a 1 s consumer_timeout")
        fleet.start_publish_loop()

        async def closed() -> bool:
            return bool(await asyncio.to_thread(_server_closed_channels, rabbit))

        assert await eventually(closed, 60), (
            "the server never closed a channel for the consumer timeout\n" + fleet.describe()
        )
        closed_at = fleet.note(
            "server closed the second consumer's channel (its log)",
            at=(await asyncio.to_thread(_server_closed_channels, rabbit))[0],
        )

        facts = Facts(fleet)
        facts.check(
            await eventually(
                _reconnected(second),
                max(0.0, closed_at + fleet.sigterm_bound - time.monotonic()),
            ),
            f"the consumer whose channel the server closed did not end its session within "
            f"{fleet.sigterm_bound:.0f} s (RELAY_SHUTDOWN_GRACE_SECONDS + 10 s)",
        )
        # Counted from the later of the close and the restored timeout: until then (34 s
        # of rabbitmqctl on a loaded machine) each new channel of the second gets 1 s too.
        await fleet.expect_all_delivered(
            facts, within=fleet.settings.lease_seconds + 30, since=max(closed_at, restored)
        )
        facts.check(
            not fleet.unrequested_exits(),
            "a consumer exited instead of reconnecting: "
            + "; ".join(map(str, fleet.unrequested_exits())),
        )
        facts.check(
            not await rs.logged(first.log, "broker_reconnect"),
            "the consumer left alone lost its channel too",
        )
        await fleet.finish(facts)
        facts.assert_all()
    finally:
        await fleet.stop()
        print(fleet.describe())


async def test_consumer_cancelled_because_its_queue_was_deleted_exits_and_rescue_refills(
    pg: PostgresNode, module_rabbit: RabbitNode, partner: RunningPartner, tmp_path: Path
) -> None:
    """The bulk lane's queue deleted (AMQP ``queue.delete``, as ``rabbitmqctl delete_queue``
    does it): the broker cancels both consumers
    (basic.cancel; channels and connection stay up) and drops the queued messages.
    Each consumer ends its session and connects again in the same process, declaring the
    queue again (as does the publish run); the publish loop's rescue republishes the rows
    whose messages were deleted."""
    rabbit = module_rabbit
    rescue_after = 15.0
    assert partner.state.verify_secret is not None
    settings = drain_settings(
        database_url=pg.url,
        amqp_url=rabbit.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
        rescue_after_seconds=rescue_after,
    )
    async with start_drain(settings, partner, tmp_path / "logs", rows=ROWS, broker=rabbit) as fleet:
        await fleet.wait_delivered(ROWS // 4, timeout=60)
        queue = f"{fleet.namespace}.deliveries"
        facts = Facts(fleet)
        # No publish run declares the queue again until the consumers have answered the
        # broker's cancel: declared again at once, RabbitMQ 3.10 sent none (that case is
        # tests/integration/test_consumer_attachment.py's).
        async with fleet.publish_paused():
            fleet.note(f"queue.delete {queue}")
            dropped = await _delete_queue(rabbit.url, queue)
            deleted = fleet.note(f"queue deleted with {dropped} messages in it")
            assert dropped > 0, "the drain ended before the queue was deleted: nothing to rescue"
            for slot in fleet.supervisor.slots:
                facts.check(
                    await eventually(
                        _reconnected(slot),
                        max(0.0, deleted + fleet.sigterm_bound - time.monotonic()),
                    ),
                    f"slot {slot.index}: no new session within {fleet.sigterm_bound:.0f} s "
                    "of its consumer's cancellation",
                )
        # The deleted messages come back through rescue: rescue_after, then the next run.
        bound = rescue_after + fleet.publish_every + fleet.settings.lease_seconds + 30
        await fleet.expect_all_delivered(facts, within=bound, since=deleted)
        rescued = await fleet.ledger.rescued()
        fleet.note(f"publish runs rescued {rescued} deliveries")
        facts.check(rescued > 0, "no publish run rescued anything: the deleted rows came back how?")
        facts.check(
            not fleet.unrequested_exits(),
            "a consumer exited instead of reconnecting: "
            + "; ".join(map(str, fleet.unrequested_exits())),
        )
        await fleet.finish(facts)
        facts.assert_all()
