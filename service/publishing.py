"""Publishing delivery messages: persistent, ``mandatory`` and confirmed by the broker.

An unroutable message is an error, never a silent drop. ``ConfirmedPublisher`` pipelines
publishes within a bound and waits for each confirm (time the connection was blocked by a
broker alarm does not count, ``service/alarms.py``); a delivery not due yet goes through
the timer ladder (``service/timer.py``), a parked one through the delay tiers, a dead one
to the dead-letter exchange. ``open_publisher`` is how every process starts publishing:
connect, declare the topology (``service/amqp.py``), open the confirming channel.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection

from service import alarms, amqp, errors, messages, timer
from service.settings import Settings

# A delivery due sooner than this goes straight to its lane.
_DUE_NOW_SECONDS = 0.005
_PERSISTENT = int(aio_pika.DeliveryMode.PERSISTENT)


class ConfirmedPublisher:
    """Publishes delivery messages on a confirming channel, pipelined and bounded."""

    def __init__(
        self,
        channel: AbstractChannel,
        topology: amqp.Topology,
        *,
        max_in_flight: int,
        timer_max_in_flight: int,
        confirm_timeout_seconds: float,
    ) -> None:
        self._channel = channel
        self._topology = topology
        self._in_flight = asyncio.Semaphore(max_in_flight)
        # A ladder level's TTL runs from when the broker takes the message (so the wait is
        # taken as it goes out): one queued in the broker's intake behind many starts late.
        self._timer_in_flight = asyncio.Semaphore(min(max_in_flight, timer_max_in_flight))
        self._timeout = confirm_timeout_seconds
        # aiormq matches a returned (unroutable) message to its publish by its message id,
        # and draws a random UUID for each publish that comes without one.
        self._message_ids = map("relay-{}".format, itertools.count(1))
        self.blocked: alarms.Blocked | None = None  # set: time blocked is not confirm time

    @classmethod
    async def open(
        cls, connection: AbstractConnection, topology: amqp.Topology, settings: Settings
    ) -> ConfirmedPublisher:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        return cls(
            channel,
            topology,
            max_in_flight=settings.publish_max_in_flight,
            timer_max_in_flight=settings.publish_timer_max_in_flight,
            confirm_timeout_seconds=settings.publish_confirm_timeout_seconds,
        )

    async def _publish(
        self, exchange_name: str, routing_key: str, body: bytes, headers: Mapping[str, Any]
    ) -> None:
        async with self._in_flight:
            await self._send(exchange_name, routing_key, body, headers)

    async def _send(
        self, exchange_name: str, routing_key: str, body: bytes, headers: Mapping[str, Any]
    ) -> None:
        """Publish one message and wait for its confirm (the caller holds a slot).

        Straight on aiormq, aio-pika's own layer: the frames ``exchange.publish`` sends,
        without an ``aio_pika.Message`` per publish. A publish run sends thousands a second,
        and that object cost more CPU than the relay's own code around it (issue 30). A
        closed channel raises here as it does in aio-pika."""
        if self._channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self._channel!r} closed")
        channel = await self._channel.get_underlay_channel()
        properties = aiormq.spec.Basic.Properties(
            content_type="application/json",
            delivery_mode=_PERSISTENT,
            headers=dict(headers),
            message_id=next(self._message_ids),
        )
        await self._confirmed(
            channel.basic_publish(
                body,
                exchange=exchange_name,
                routing_key=routing_key,
                properties=properties,
                mandatory=True,
            )
        )

    async def _confirmed(self, publishing: Awaitable[object]) -> None:
        """Await a publish and its confirm (``alarms.confirmed``); PublishError if none."""
        try:
            await alarms.confirmed(publishing, self._timeout, self.blocked)
        except (TimeoutError, aiormq.exceptions.AMQPError, OSError) as exc:
            raise errors.PublishError(f"publish not confirmed: {type(exc).__name__}") from exc

    async def publish_delivery(
        self, delivery_id: int, *, urgent: bool, headers: Mapping[str, Any] | None = None
    ) -> None:
        """Publish one delivery to its lane and wait for the broker's confirm."""
        body, lane = messages.encode(delivery_id), amqp.lane_of(urgent)
        await self._publish(self._topology.work_exchange, lane, body, headers or {})

    async def publish_due(
        self, delivery_id: int, *, urgent: bool, due_in_seconds: float, headers: Mapping[str, Any]
    ) -> None:
        """Publish one delivery so that it reaches its lane when it falls due: at once if
        it is due, else through the timer ladder (``service/timer.py``). If the ladder
        returns it unroutable (a level's node is down: classic queues are not replicated),
        it hops through the delay tiers instead, and the consumer holds it until due."""
        loop = asyncio.get_running_loop()
        due_at = loop.time() + due_in_seconds
        body, lane = messages.encode(delivery_id), amqp.lane_of(urgent)
        if due_in_seconds <= _DUE_NOW_SECONDS:
            return await self._publish(self._topology.work_exchange, lane, body, headers)
        async with self._timer_in_flight, self._in_flight:
            remaining = due_at - loop.time()
            if remaining <= _DUE_NOW_SECONDS:
                await self._send(self._topology.work_exchange, lane, body, headers)
                return
            try:
                entrance, routing = timer.route(self._topology.namespace, remaining)
                await self._send(entrance, lane, body, {**headers, **routing})
                return
            except errors.PublishError as exc:
                if not isinstance(exc.__cause__, aiormq.exceptions.PublishError):
                    raise
        remaining = max(due_at - loop.time(), 0.0)
        await self.publish_delayed(body, lane=lane, remaining_seconds=remaining, headers=headers)

    async def publish_many(
        self,
        items: Iterable[tuple[int, bool]] | Iterable[tuple[int, bool, float]],
        headers: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Publish (delivery_id, urgent[, seconds until due]) pipelined, in the given
        order; return (confirmed, failed) ids. Items not due yet go through the timer
        ladder, each with the wait left when it goes out."""
        ids: list[int] = []
        tasks: list[asyncio.Task[None]] = []
        table = headers or {}  # each publish copies it into its own properties
        for delivery_id, urgent, *due in items:
            ids.append(delivery_id)
            in_seconds = due[0] if due else 0.0
            work = self.publish_due(
                delivery_id, urgent=urgent, due_in_seconds=in_seconds, headers=table
            )
            tasks.append(asyncio.ensure_future(work))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        confirmed = [i for i, r in zip(ids, results, strict=True) if r is None]
        failed = [i for i, r in zip(ids, results, strict=True) if r is not None]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # never swallow cancellation
        return confirmed, failed

    async def publish_delayed(
        self,
        body: bytes,
        *,
        lane: str,
        remaining_seconds: float,
        headers: Mapping[str, Any] | None = None,
    ) -> float:
        """Park a message in the delay tier that fits; return that tier's length (s)."""
        tier = self._topology.tier_for(remaining_seconds)
        await self._publish(
            self._topology.delay_exchange,
            lane,
            body,
            {**(headers or {}), amqp.TIER_HEADER: self._topology.delay_queue(tier)},
        )
        return tier

    async def publish_copy(
        self, body: bytes, *, lane: str, headers: Mapping[str, Any] | None = None
    ) -> None:
        """Publish a fresh copy of a delivery message to its lane (a hand-back: the copy
        starts with a delivery count of zero, unlike a nacked original)."""
        await self._publish(self._topology.work_exchange, lane, body, headers or {})

    async def publish_dead(self, body: bytes, headers: Mapping[str, Any]) -> None:
        """Send a message to the dead-letter exchange, with headers saying why."""
        await self._publish(self._topology.dead_exchange, "", body, headers)

    @property
    def closed(self) -> bool:
        return self._channel.is_closed

    @property
    def channel(self) -> AbstractChannel:
        return self._channel

    async def close(self) -> None:
        if not self._channel.is_closed:
            await self._channel.close()


async def open_publisher(
    settings: Settings, role: str, *, announce_alarms: bool = True
) -> tuple[AbstractConnection, ConfirmedPublisher]:
    """Connect, declare the topology, and open a confirming publisher that sees the
    broker's alarms (``publisher.blocked``): a publish the broker holds back because a
    memory or disk alarm blocks the connection waits the alarm out, whoever publishes.
    ``announce_alarms``: log each block (a caller that reacts to them logs its own)."""
    topology = amqp.Topology.from_settings(settings)
    connection = await amqp.connect(settings, name=f"{role}@{socket.gethostname()}")
    try:
        async with asyncio.timeout(settings.amqp_timeout_seconds):
            channel = await connection.channel()
            await amqp.declare(channel, topology)
            await channel.close()
            publisher = await ConfirmedPublisher.open(connection, topology, settings)
            publisher.blocked = alarms.watch(connection)  # before its first publish
            if announce_alarms:
                alarms.announce(publisher.blocked, role)
            return connection, publisher
    except (aiormq.exceptions.AMQPError, OSError, TimeoutError) as exc:
        await amqp.close_connection(connection, settings.amqp_timeout_seconds)
        raise errors.UnavailableError(f"broker unusable: {type(exc).__name__}") from exc
