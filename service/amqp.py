"""Broker topology (names and idempotent declaration), connections, confirmed publishing.

Topology, all durable, names prefixed by the namespace (default ``relay``):

- ``<ns>.work`` (direct) routes lane keys ``bulk`` and ``urgent`` to the quorum queues
  ``<ns>.deliveries`` and ``<ns>.deliveries.urgent``; both dead-letter (at-least-once)
  to ``<ns>.dlx`` after ``x-delivery-limit`` redeliveries.
- ``<ns>.delay`` (headers) routes by header ``x-relay-tier`` to one quorum queue per
  delay tier, ``<ns>.delay.<ms>ms``, whose TTL dead-letters back to ``<ns>.work`` with the
  message's own routing key, i.e. back to its lane. No broker plugin is needed.
- ``<ns>.timer.<ms>ms``: the timer ladder (``service/timer.py``). A delivery admitted
  before it is due waits in classic queues of fixed TTL and reaches ``<ns>.work`` with its
  lane's routing key at its due time (rounded up to 50 ms), never held back by another.
- ``<ns>.dlx`` (fanout) -> ``<ns>.dead-letters``, read by ``relay replay``.

Every publish is persistent, ``mandatory`` and confirmed: an unroutable message is an
error, never a silent drop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from service import alarms, brokers, errors, messages, servers, timer
from service.settings import Settings

# A delivery due sooner than this goes straight to its lane.
_DUE_NOW_SECONDS = 0.005
BULK = "bulk"
URGENT = "urgent"
# Not "x-" prefixed: a headers exchange ignores x- headers when matching.
TIER_HEADER = "relay-delay-tier"
REASON_HEADER = "x-relay-reason"
# When a dead letter was published (Unix ms): a queue replay leaves newer ones alone.
DEAD_AT_HEADER = "x-relay-dead-at"


@dataclass(frozen=True)
class Topology:
    """Every exchange and queue name, derived from the namespace."""

    namespace: str
    delay_tiers_seconds: tuple[float, ...]
    delivery_limit: int
    quorum_group_size: int = 0  # 0: x-quorum-initial-group-size not sent

    @classmethod
    def from_settings(cls, settings: Settings) -> Topology:
        return cls(
            namespace=settings.amqp_namespace,
            delay_tiers_seconds=tuple(settings.delay_tiers_seconds),
            delivery_limit=settings.amqp_delivery_limit,
            quorum_group_size=settings.amqp_quorum_group_size,
        )

    @property
    def work_exchange(self) -> str:
        return f"{self.namespace}.work"

    @property
    def delay_exchange(self) -> str:
        return f"{self.namespace}.delay"

    @property
    def timer_entrance(self) -> str:
        return timer.entrance(self.namespace)

    @property
    def timer_queues(self) -> list[str]:
        return timer.queues(self.namespace)

    @property
    def dead_exchange(self) -> str:
        return f"{self.namespace}.dlx"

    @property
    def dead_queue(self) -> str:
        return f"{self.namespace}.dead-letters"

    def lane_queue(self, lane: str) -> str:
        return f"{self.namespace}.deliveries" + (".urgent" if lane == URGENT else "")

    def delay_queue(self, tier_seconds: float) -> str:
        return f"{self.namespace}.delay.{round(tier_seconds * 1000)}ms"

    def tier_for(self, remaining_seconds: float) -> float:
        """The largest tier not longer than what remains (the smallest if all are longer).

        A long delay hops through several tiers; the consumer re-delays a message that
        comes back before its row's next_attempt_at, so a hop never fires early.
        """
        fitting = [t for t in self.delay_tiers_seconds if t <= remaining_seconds]
        return fitting[-1] if fitting else self.delay_tiers_seconds[0]

    def waiting_queues(self) -> list[str]:
        """The queues an owed delivery's message waits in: lanes, timer ladder, delay tiers."""
        return [q for q in self.all_queues() if q != self.dead_queue]

    def all_queues(self) -> list[str]:
        return [
            self.lane_queue(BULK),
            self.lane_queue(URGENT),
            self.dead_queue,
            *self.timer_queues,
            *(self.delay_queue(t) for t in self.delay_tiers_seconds),
        ]


def lane_of(urgent: bool) -> str:
    return URGENT if urgent else BULK


async def connect(settings: Settings, *, name: str) -> AbstractConnection:
    """Open a connection named after its process; raise UnavailableError naming the broker
    (host:port and vhost, never the URL) and the cause if it cannot be opened.

    Several nodes are tried in turn (``brokers.connect_first``). The heartbeat makes a
    broker that stops answering a closed connection within ~2 x ``amqp_heartbeat_seconds``.
    """
    servers.quiet_transport_errors()

    async def open_one(url: str) -> AbstractConnection:
        return await aio_pika.connect(
            url,
            client_properties={"connection_name": name},
            timeout=settings.amqp_timeout_seconds,
            heartbeat=settings.amqp_heartbeat_seconds,
        )

    urls = servers.one_url_per_host(settings.amqp_url.get_secret_value())
    try:
        return await brokers.connect_first(urls, open_one)
    except brokers.NODE_ERRORS as exc:
        raise errors.UnavailableError(servers.broker_unreachable(exc, settings)) from exc
    except ValueError as exc:  # the client refused a URL the settings let through
        raise errors.ConfigError(
            f"RELAY_AMQP_URL: not a URL the client accepts ({type(exc).__name__})"
        ) from None


async def declare(channel: AbstractChannel, topology: Topology) -> None:
    """Declare the whole topology. Idempotent: every process does it at start-up."""
    work = await channel.declare_exchange(
        topology.work_exchange, aio_pika.ExchangeType.DIRECT, durable=True
    )
    dlx = await channel.declare_exchange(
        topology.dead_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    delay = await channel.declare_exchange(
        topology.delay_exchange, aio_pika.ExchangeType.HEADERS, durable=True
    )
    # at-least-once dead-lettering only works with reject-publish overflow (RabbitMQ 3.10).
    safe_dead_lettering = {
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    for lane in (BULK, URGENT):
        queue = await brokers.declare_quorum(
            channel,
            topology.lane_queue(lane),
            {
                "x-delivery-limit": topology.delivery_limit,
                "x-dead-letter-exchange": topology.dead_exchange,
                **safe_dead_lettering,
            },
            topology.quorum_group_size,
        )
        await queue.bind(work, routing_key=lane)
    dead = await brokers.declare_quorum(
        channel, topology.dead_queue, {}, topology.quorum_group_size
    )
    await dead.bind(dlx)
    await timer.declare(channel, topology.namespace, work)
    for tier in topology.delay_tiers_seconds:
        tier_queue = await brokers.declare_quorum(
            channel,
            topology.delay_queue(tier),
            {
                "x-message-ttl": round(tier * 1000),
                "x-dead-letter-exchange": topology.work_exchange,
                **safe_dead_lettering,
            },
            topology.quorum_group_size,
        )
        await tier_queue.bind(
            delay, arguments={"x-match": "all", TIER_HEADER: topology.delay_queue(tier)}
        )


class ConfirmedPublisher:
    """Publishes delivery messages on a confirming channel, pipelined and bounded."""

    def __init__(
        self,
        channel: AbstractChannel,
        topology: Topology,
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
        self._exchanges: dict[str, AbstractExchange] = {}
        self.blocked: alarms.Blocked | None = None  # set: time blocked is not confirm time

    @classmethod
    async def open(
        cls, connection: AbstractConnection, topology: Topology, settings: Settings
    ) -> ConfirmedPublisher:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        return cls(
            channel,
            topology,
            max_in_flight=settings.publish_max_in_flight,
            timer_max_in_flight=settings.publish_timer_max_in_flight,
            confirm_timeout_seconds=settings.publish_confirm_timeout_seconds,
        )

    async def _exchange(self, name: str) -> AbstractExchange:
        if name not in self._exchanges:
            self._exchanges[name] = await self._channel.get_exchange(name, ensure=False)
        return self._exchanges[name]

    async def _publish(
        self, exchange_name: str, routing_key: str, body: bytes, headers: Mapping[str, Any]
    ) -> None:
        async with self._in_flight:
            await self._send(exchange_name, routing_key, body, headers)

    async def _send(
        self, exchange_name: str, routing_key: str, body: bytes, headers: Mapping[str, Any]
    ) -> None:
        """Publish one message and wait for its confirm (the caller holds a slot)."""
        exchange = await self._exchange(exchange_name)
        message = aio_pika.Message(
            body,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers=dict(headers),
        )
        try:
            publishing = exchange.publish(message, routing_key, mandatory=True)
            await alarms.confirmed(publishing, self._timeout, self.blocked)
        except (TimeoutError, aiormq.exceptions.AMQPError, OSError) as exc:
            raise errors.PublishError(f"publish not confirmed: {type(exc).__name__}") from exc

    async def publish_delivery(
        self, delivery_id: int, *, urgent: bool, headers: Mapping[str, Any] | None = None
    ) -> None:
        """Publish one delivery to its lane and wait for the broker's confirm."""
        body, lane = messages.encode(delivery_id), lane_of(urgent)
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
        body, lane = messages.encode(delivery_id), lane_of(urgent)
        if due_in_seconds <= _DUE_NOW_SECONDS:
            return await self._publish(self._topology.work_exchange, lane, body, headers)
        async with self._timer_in_flight, self._in_flight:
            remaining = due_at - loop.time()
            if remaining <= _DUE_NOW_SECONDS:
                await self._send(self._topology.work_exchange, lane, body, headers)
                return
            try:
                ladder = {**headers, **timer.headers_for(remaining)}
                await self._send(self._topology.timer_entrance, lane, body, ladder)
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
        for delivery_id, urgent, *due in items:
            ids.append(delivery_id)
            tasks.append(
                asyncio.ensure_future(
                    self.publish_due(
                        delivery_id,
                        urgent=urgent,
                        due_in_seconds=due[0] if due else 0.0,
                        headers=headers or {},
                    )
                )
            )
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
            {**(headers or {}), TIER_HEADER: self._topology.delay_queue(tier)},
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
    settings: Settings, role: str
) -> tuple[AbstractConnection, ConfirmedPublisher]:
    """Connect, declare the topology, and open a confirming publisher."""
    topology = Topology.from_settings(settings)
    connection = await connect(settings, name=f"{role}@{socket.gethostname()}")
    try:
        async with asyncio.timeout(settings.amqp_timeout_seconds):
            channel = await connection.channel()
            await declare(channel, topology)
            await channel.close()
            return connection, await ConfirmedPublisher.open(connection, topology, settings)
    except (aiormq.exceptions.AMQPError, OSError, TimeoutError) as exc:
        await close_connection(connection, settings.amqp_timeout_seconds)
        raise errors.UnavailableError(f"broker unusable: {type(exc).__name__}") from exc


async def close_connection(connection: AbstractConnection, timeout_seconds: float) -> None:
    """Close within the deadline; a broker that does not answer it is left to the OS."""
    try:
        async with asyncio.timeout(timeout_seconds):
            await connection.close()
    except (TimeoutError, aiormq.exceptions.AMQPError, OSError):
        pass


async def delete_topology(channel: AbstractChannel, topology: Topology) -> None:
    """Remove every queue and exchange of a namespace (demo reset, test teardown)."""
    for queue in topology.all_queues():
        await channel.queue_delete(queue)
    for exchange in (topology.work_exchange, topology.delay_exchange, topology.dead_exchange):
        await channel.exchange_delete(exchange)
    for exchange in topology.timer_queues:  # each level's exchange has its queue's name
        await channel.exchange_delete(exchange)
