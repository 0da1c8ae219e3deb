"""The timer ladder: where a delivery admitted before its due time waits in the broker.

A publish run admits what falls due within its look-ahead and hands each delivery not yet
due to the ladder: classic queues ``<ns>.timer.<ms>ms`` with ms = 50 x 2^j (j = 0..16,
50 ms to 54.6 min), each with a queue-level TTL. The wait, rounded up to 50 ms (so never
early), is written in binary: the message visits the queue of each 1-bit, largest first,
and leaves the smallest one onto ``<ns>.work`` with its lane's routing key. The longest
wait the ladder holds (109 min) exceeds the longest look-ahead the settings allow.

Routing is by headers: exchange ``<ns>.timer.<ms>ms`` decides its level (header
``relay-timer-<ms>ms``: "1" into that level's queue, "0" on to the next lower level's
exchange; below the lowest is ``<ns>.work``), and each level's queue dead-letters to the
next lower level's exchange. A delivery enters at the exchange of its wait's highest
1-bit and carries headers for that level and those below only: the levels above would
only pass it on, each a routing step that matches its headers (~15 % of the broker's CPU
per ladder message, ``docs/decisions.md``), and the consumer decodes every header.

Every message of one queue waits the same time, so each leaves exactly its TTL after it
entered, whatever is ahead of it: no delivery is ever held back by one due later. (One
queue with per-message TTLs expires only its head, so a long wait at the head held back
every shorter one published behind it.)

A classic queue lives on one node: while that node is down a publish routed to one of its
levels comes back unroutable (the caller then uses the delay tiers), and a message passing
between levels when a node goes is dropped (classic dead-lettering is at-most-once). The
ledger covers both: the consumer's overdue sweep republishes a queued row whose message
has not come (``consumer/overdue.py``).
"""

from __future__ import annotations

import math

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange

from service import brokers

UNIT_MS = 50
LEVELS = 17
# Not "x-" prefixed: a headers exchange ignores x- headers when matching.
_HEADER = "relay-timer-{ms}ms"


def level_ms(level: int) -> int:
    """The TTL of one level's queue (ms)."""
    return UNIT_MS << level


def level_name(namespace: str, level: int) -> str:
    """The name of one level's queue and of the exchange that decides it."""
    return f"{namespace}.timer.{level_ms(level)}ms"


def queues(namespace: str) -> list[str]:
    """Every level's queue, shortest first."""
    return [level_name(namespace, level) for level in range(LEVELS)]


def longest_seconds() -> float:
    """The longest wait the ladder holds: every level once."""
    return ((1 << LEVELS) - 1) * UNIT_MS / 1000


def units_for(remaining_seconds: float) -> int:
    """The wait in ladder units: rounded up (a delivery never leaves before its due time),
    at least one, at most the ladder's longest (a longer one comes back early and the
    consumer parks it for the rest)."""
    units = math.ceil(round(remaining_seconds * 1000 / UNIT_MS, 6))
    return max(1, min(units, (1 << LEVELS) - 1))


def route(namespace: str, remaining_seconds: float) -> tuple[str, dict[str, str]]:
    """Where a delivery due in ``remaining_seconds`` enters the ladder (the exchange of its
    wait's highest 1-bit), and its routing headers: one per level from there down."""
    units = units_for(remaining_seconds)
    top = units.bit_length() - 1
    headers = {
        _HEADER.format(ms=level_ms(level)): "1" if units >> level & 1 else "0"
        for level in range(top + 1)
    }
    return level_name(namespace, top), headers


async def declare(channel: AbstractChannel, namespace: str, work: AbstractExchange) -> None:
    """Declare the ladder, lowest level first (each level passes on to the one below).

    Idempotent. A level whose queue's node is down keeps its exchange and its "0" route;
    a delivery that needs that level is then unroutable, and the publisher falls back to
    the delay tiers.
    """
    below = work
    for level in range(LEVELS):
        name = level_name(namespace, level)
        header = _HEADER.format(ms=level_ms(level))
        decide = await channel.declare_exchange(name, aio_pika.ExchangeType.HEADERS, durable=True)
        queue = await brokers.declare_classic(
            channel,
            name,
            {
                "x-queue-type": "classic",
                "x-message-ttl": level_ms(level),
                "x-dead-letter-exchange": below.name,
            },
        )
        if queue is not None:  # None: its node is down (bound when it was declared)
            await queue.bind(decide, arguments={"x-match": "all", header: "1"})
        await below.bind(decide, arguments={"x-match": "all", header: "0"})
        below = decide
