"""A broker that is several nodes: connecting to one that answers, and replicating queues.

``RELAY_AMQP_URL`` may name a cluster's nodes as comma-separated hosts of one URL. A
connection tries them in turn from a random one, so replicas spread over the cluster and
a lost node costs one more connection attempt, not a failed start. Quorum queues are
declared with ``x-quorum-initial-group-size`` (``RELAY_AMQP_QUORUM_GROUP_SIZE``) when it
is set; a queue that already exists with another group size is used as it is. The timer
queue (classic, not replicated) is skipped while the node it lives on is down.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue

from service import logs

GROUP_SIZE = "x-quorum-initial-group-size"
# What a node that cannot be used raises; the next node is tried.
NODE_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, OSError, aiormq.exceptions.AMQPError)

log = logs.get("amqp")
T = TypeVar("T")


def in_turn(urls: list[str], first: int) -> list[str]:
    """The nodes in the order given, starting at index ``first`` and wrapping around."""
    first %= len(urls)
    return urls[first:] + urls[:first]


async def connect_first(
    urls: list[str],
    open_one: Callable[[str], Awaitable[T]],
    *,
    first: int | None = None,
) -> T:
    """What ``open_one`` returns for the first node that answers, trying each in turn
    from ``first`` (default: a random node); the last node's error if none does."""
    start = random.randrange(len(urls)) if first is None else first
    failure: BaseException | None = None
    for url in in_turn(urls, start):
        try:
            return await open_one(url)
        except NODE_ERRORS as exc:
            failure = exc
    assert failure is not None
    raise failure


def quorum_arguments(group_size: int, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A quorum queue's arguments: its type, its replicas (0: the broker's default), then
    ``arguments``."""
    size = {GROUP_SIZE: group_size} if group_size else {}
    return {"x-queue-type": "quorum", **size, **arguments}


async def declare_quorum(
    channel: AbstractChannel, name: str, arguments: Mapping[str, Any], group_size: int
) -> AbstractQueue:
    """Declare one durable quorum queue. Only a new queue takes an initial group size: one
    that exists with another (declared before RELAY_AMQP_QUORUM_GROUP_SIZE changed) is
    used as it is, since RabbitMQ refuses a declaration whose arguments differ
    (PRECONDITION_FAILED); its members change with ``rabbitmq-queues grow`` instead."""
    try:
        return await channel.declare_queue(
            name, durable=True, arguments=quorum_arguments(group_size, arguments)
        )
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        if GROUP_SIZE not in str(exc):
            raise
    await channel.reopen()  # the refusal closed the channel
    log.warning(
        "queue exists with another initial group size; kept as it is",
        extra={"event": "queue_group_size_kept", "queue": name},
    )
    return await channel.declare_queue(name, passive=True)


async def declare_classic(
    channel: AbstractChannel, name: str, arguments: Mapping[str, Any]
) -> AbstractQueue | None:
    """Declare one durable classic queue; None if it lives on a cluster node that is down.

    A classic queue is not replicated: while its node is down RabbitMQ refuses to declare
    it (NOT_FOUND, "home node ... is down") and a publish routed only to it comes back
    unroutable (a PublishError for a mandatory publish, so nothing is marked published).
    Declaring everything else must go on, so that losing that node stops nothing else.
    """
    try:
        return await channel.declare_queue(name, durable=True, arguments=dict(arguments))
    except aiormq.exceptions.ChannelNotFoundEntity as exc:
        if "home node" not in str(exc):
            raise
    await channel.reopen()  # the refusal closed the channel
    log.warning(
        "queue unavailable: its cluster node is down",
        extra={"event": "queue_node_down", "queue": name},
    )
    return None


async def ready_count(channel: AbstractChannel, name: str) -> int:
    """Messages ready in a queue now; 0 for a classic queue whose node is down (its
    messages cannot be had until it returns, so rescue and the gauges count none)."""
    try:
        queue = await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity as exc:
        if "home node" not in str(exc):
            raise
        await channel.reopen()  # the refusal closed the channel
        return 0
    return queue.declaration_result.message_count or 0


async def ready_total(
    connection: AbstractConnection, names: Iterable[str], timeout_seconds: float
) -> int:
    """Messages ready in these queues now (not those held by consumers), on a channel of
    its own, within the deadline."""
    async with asyncio.timeout(timeout_seconds):
        channel = await connection.channel()
        try:
            total = 0
            for name in names:
                total += await ready_count(channel, name)
            return total
        finally:
            await channel.close()
