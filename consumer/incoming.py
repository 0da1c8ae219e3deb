"""Delivery messages as the worker reads them, straight from aiormq's frames.

aio-pika's ``Queue.consume`` wraps every delivered message in an ``IncomingMessage`` (some
thirty attribute writes, each through a checking ``__setattr__``). The worker reads five
fields and needs two verbs, so it consumes on the channel's aiormq underlay and reads
them off the frame: one small object per message (``docs/benchmarks.md``). The channel,
its QoS, the queue declarations and the publisher stay aio-pika's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands


class Incoming:
    """One delivery message: its body, where it came from, its headers; ack or nack it."""

    __slots__ = ("_message", "body", "delivery_tag", "exchange", "routing_key")

    def __init__(self, message: DeliveredMessage) -> None:
        frame = message.delivery
        assert isinstance(frame, commands.Basic.Deliver)
        self.body: bytes = message.body
        self.routing_key: str | None = frame.routing_key
        self.exchange: str | None = frame.exchange
        self.delivery_tag: int | None = frame.delivery_tag
        self._message = message

    @property
    def settleable(self) -> bool:
        """False once the channel it came on closed: the broker has put it back already."""
        return not self._message.channel.is_closed

    @property
    def headers(self) -> dict[str, Any]:
        return self._message.header.properties.headers or {}

    async def ack(self) -> None:
        assert self.delivery_tag is not None
        await self._message.channel.basic_ack(self.delivery_tag)

    async def nack(self, *, requeue: bool = True) -> None:
        assert self.delivery_tag is not None
        await self._message.channel.basic_nack(self.delivery_tag, requeue=requeue)


async def consume(
    channel: aiormq.abc.AbstractChannel,
    queue: str,
    accept: Callable[[Incoming], None],
) -> str:
    """Start consuming ``queue`` (manual acks); ``accept`` takes each message and must not
    wait: aiormq runs it in a task of the channel's, which it cancels when the channel
    closes, so the work itself belongs in a task of the caller's. Returns the consumer
    tag, for ``basic_cancel``."""

    async def on_delivered(message: DeliveredMessage) -> None:
        accept(Incoming(message))

    ok = await channel.basic_consume(queue, on_delivered, no_ack=False)
    assert ok.consumer_tag is not None
    return ok.consumer_tag
