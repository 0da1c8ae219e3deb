"""Broker topology (names and idempotent declaration) and connections. Publishing with
confirms is ``service/publishing.py``.

Topology, all durable, names prefixed by the namespace (default ``relay``):

- ``<ns>.work`` (direct) routes lane keys ``bulk`` and ``urgent`` to the quorum queues
  ``<ns>.deliveries`` and ``<ns>.deliveries.urgent``; both dead-letter (at-least-once)
  to ``<ns>.dlx`` after ``x-delivery-limit`` redeliveries.
- ``<ns>.delay`` (headers) routes by header ``x-relay-tier`` to one quorum queue per
  delay tier, ``<ns>.delay.<ms>ms``, whose TTL dead-letters back to ``<ns>.work`` with the
  message's own routing key, i.e. back to its lane. No broker plugin is needed.
- ``<ns>.ladder.level<j>`` and ``<ns>.ladder.<ms>ms``: the timer ladder's exchanges and
  queues (``service/timer.py``). A delivery admitted
  before it is due waits in classic queues of fixed TTL and reaches ``<ns>.work`` with its
  lane's routing key at its due time (rounded up to 50 ms), never held back by another.
- ``<ns>.dlx`` (fanout) -> ``<ns>.dead-letters``, read by ``relay replay``.

"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection

from service import brokers, errors, servers, timer
from service.settings import Settings

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
    def timer_queues(self) -> list[str]:
        return timer.queues(self.namespace)

    @property
    def timer_exchanges(self) -> list[str]:
        return timer.exchanges(self.namespace)

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
    # The longest delay tier is declared last: its queue existing means every binding above
    # is in place (tests/support/relay.py's ``topology_declared`` waits for it).
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
    for exchange in topology.timer_exchanges:
        await channel.exchange_delete(exchange)
