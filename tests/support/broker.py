"""Test helpers on the broker side: declare a test's topology, publish raw bodies, count
and read what its queues hold. Each call opens its own short connection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from service import amqp
from service.settings import Settings


@asynccontextmanager
async def channel(settings: Settings, *, confirms: bool = False) -> AsyncIterator[AbstractChannel]:
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        yield await connection.channel(publisher_confirms=confirms)


def topology(settings: Settings) -> amqp.Topology:
    return amqp.Topology.from_settings(settings)


def lanes_and_tiers(settings: Settings) -> list[str]:
    """Every queue a delivery message waits in: both lanes, the timer ladder, every delay
    tier."""
    return topology(settings).waiting_queues()


async def declare(settings: Settings) -> None:
    async with channel(settings) as ch:
        await amqp.declare(ch, topology(settings))


async def publish_raw(settings: Settings, bodies: list[bytes], *, lane: str = amqp.BULK) -> None:
    """Publish bodies as they are to a lane, with confirms."""
    async with channel(settings, confirms=True) as ch:
        exchange = await ch.get_exchange(topology(settings).work_exchange)
        for body in bodies:
            await exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                lane,
                mandatory=True,
            )


async def publish_dead(settings: Settings, body: bytes, headers: dict[str, object]) -> None:
    """Put a dead letter straight into the dead-letter exchange."""
    async with channel(settings, confirms=True) as ch:
        exchange = await ch.get_exchange(topology(settings).dead_exchange)
        await exchange.publish(
            aio_pika.Message(body, headers=headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            "",
            mandatory=True,
        )


async def count(settings: Settings, names: list[str]) -> int:
    """Messages ready in these queues now."""
    total = 0
    async with channel(settings) as ch:
        for name in names:
            queue = await ch.declare_queue(name, passive=True)
            total += int(queue.declaration_result.message_count or 0)
    return total


async def waiting(settings: Settings) -> int:
    """Delivery messages ready in the lanes and delay tiers."""
    return await count(settings, lanes_and_tiers(settings))


async def dead_count(settings: Settings) -> int:
    return await count(settings, [topology(settings).dead_queue])


async def read(settings: Settings, name: str, *, remove: bool) -> list[AbstractIncomingMessage]:
    """Every message ready in one queue; removed (acked) or left in place (requeued)."""
    found: list[AbstractIncomingMessage] = []
    async with channel(settings) as ch:
        queue = await ch.declare_queue(name, passive=True)
        while (message := await queue.get(fail=False)) is not None:
            found.append(message)
        for message in found:
            if remove:
                await message.ack()
            else:
                await message.nack(requeue=True)
    return found


async def purge(settings: Settings, names: list[str]) -> int:
    purged = 0
    async with channel(settings) as ch:
        for name in names:
            queue = await ch.declare_queue(name, passive=True)
            purged += int((await queue.purge()).message_count or 0)
    return purged
