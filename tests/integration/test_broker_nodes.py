"""RELAY_AMQP_URL naming several nodes (issue 19), against the real broker: a node that
refuses is skipped for the next one; when every node refuses, the one-line error names
them all; quorum queues that exist with another initial group size are used as they are."""

from __future__ import annotations

import aio_pika
import pytest
from pydantic import SecretStr

from service import amqp, errors, publishing
from service.settings import Settings
from tests.support import broker
from tests.support.nodes import free_port

pytestmark = pytest.mark.timeout(60)


def _listing(*ports: int) -> SecretStr:
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return SecretStr(f"amqp://guest:guest@{hosts}/")


async def test_a_node_that_refuses_is_skipped_whichever_node_is_tried_first(
    settings: Settings,
) -> None:
    dead = free_port()
    real = settings.amqp_address().hosts[0][1]
    nodes = settings.model_copy(update={"amqp_url": _listing(dead, real, dead)})
    for _ in range(6):  # a random node is tried first: every order works
        connection = await amqp.connect(nodes, name="relay-test")
        try:
            assert not connection.is_closed
        finally:
            await amqp.close_connection(connection, 5)


async def test_every_node_refusing_is_one_error_naming_them_all(settings: Settings) -> None:
    first, second = free_port(), free_port()
    nodes = settings.model_copy(update={"amqp_url": _listing(first, second)})
    with pytest.raises(errors.UnavailableError) as raised:
        await amqp.connect(nodes, name="relay-test")
    message = str(raised.value)
    assert f"127.0.0.1:{first},127.0.0.1:{second}" in message
    assert "connection refused" in message and "guest" not in message


async def test_queues_declared_with_another_group_size_are_kept_and_usable(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.declare(settings)  # no group size: the broker's default
    resized = settings.model_copy(update={"amqp_quorum_group_size": 1})
    connection, publisher = await publishing.open_publisher(resized, "relay-test")
    try:
        await publisher.publish_delivery(7, urgent=False)
    finally:
        await amqp.close_connection(connection, 5)
    kept = [r for r in caplog.records if getattr(r, "event", "") == "queue_group_size_kept"]
    assert {getattr(r, "queue", "") for r in kept} == set(
        amqp.Topology.from_settings(settings).all_queues()
    ) - set(amqp.Topology.from_settings(settings).timer_queues)
    async with broker.channel(settings) as channel:
        queue = await channel.declare_queue(
            amqp.Topology.from_settings(settings).lane_queue(amqp.BULK), passive=True
        )
        message = await queue.get(timeout=5, fail=False)
        assert message is not None and isinstance(message, aio_pika.IncomingMessage)
        await message.ack()


async def test_a_new_namespace_takes_the_group_size(settings: Settings) -> None:
    sized = settings.model_copy(update={"amqp_quorum_group_size": 1})
    connection, publisher = await publishing.open_publisher(sized, "relay-test")
    try:
        await publisher.publish_delivery(8, urgent=True)
    finally:
        await amqp.close_connection(connection, 5)
    # Declared again with the same argument: accepted as it is (no precondition failure).
    again, _ = await publishing.open_publisher(sized, "relay-test")
    await amqp.close_connection(again, 5)
    assert (
        await broker.count(sized, [amqp.Topology.from_settings(sized).lane_queue(amqp.URGENT)]) == 1
    )
