"""The timer ladder: where a delivery admitted before its due time waits in the broker.

A publish run admits what falls due within its look-ahead and hands each delivery not yet
due to the ladder. The wait, rounded up to 50 ms (so never early), is written in base 8:
level j counts units of 50 x 8^j ms, and has a classic queue for each nonzero digit d,
``<ns>.ladder.<ms>ms`` with a queue-level TTL of ms = d x 50 x 8^j. The message visits one
queue per nonzero digit, highest level first, and leaves the lowest onto ``<ns>.work``
with its lane's routing key. Six levels (42 queues) hold 218 min, more than the longest
look-ahead the settings allow.

Routing is by headers: exchange ``<ns>.ladder.level<j>`` decides level j (header
``relay-ladder-<j>``: digit d into that level's queue for d, "0" on to the next lower
level's exchange; below the lowest is ``<ns>.work``), and each of a level's queues
dead-letters to the next lower level's exchange. A delivery enters at the exchange of its
wait's highest nonzero digit and carries headers for that level and those below only: the
levels above would only pass it on, each a routing step that matches its headers.

Why base 8 and not 2: every queue a message visits is a dead-lettering in the broker, and
RabbitMQ adds an ``x-death`` entry per queue that aiormq decodes in Python for the
consumer. A wait of the default look-ahead (75 s) visits at most 4 queues in base 8,
against up to 10 in binary (``docs/decisions.md``).

Every message of one queue waits the same time, so each leaves exactly its TTL after it
entered, whatever is ahead of it: no delivery is ever held back by one due later. (One
queue with per-message TTLs expires only its head, so a long wait at the head held back
every shorter one published behind it.)

A classic queue lives on one node: while that node is down a publish routed to one of its
queues comes back unroutable (the caller then uses the delay tiers), and a message passing
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
_DIGIT_BITS = 3
BASE = 1 << _DIGIT_BITS  # 8
LEVELS = 6
_LONGEST_UNITS = (1 << _DIGIT_BITS * LEVELS) - 1  # every level's longest queue once
# Not "x-" prefixed: a headers exchange ignores x- headers when matching.
_HEADER = "relay-ladder-{level}"


def level_ms(level: int) -> int:
    """One unit of a level's digit (ms): each of its queues holds a multiple of it."""
    return UNIT_MS << _DIGIT_BITS * level


def queue_name(namespace: str, level: int, digit: int) -> str:
    """The queue that holds ``digit`` units of ``level``: named by its TTL."""
    return f"{namespace}.ladder.{digit * level_ms(level)}ms"


def exchange_name(namespace: str, level: int) -> str:
    """The exchange that decides one level: into its digit's queue, or on down."""
    return f"{namespace}.ladder.level{level}"


def queues(namespace: str) -> list[str]:
    """Every level's queues, shortest first."""
    return [
        queue_name(namespace, level, digit) for level in range(LEVELS) for digit in range(1, BASE)
    ]


def exchanges(namespace: str) -> list[str]:
    """Every level's exchange, lowest first."""
    return [exchange_name(namespace, level) for level in range(LEVELS)]


def longest_seconds() -> float:
    """The longest wait the ladder holds: every level's longest queue once."""
    return _LONGEST_UNITS * UNIT_MS / 1000


def units_for(remaining_seconds: float) -> int:
    """The wait in ladder units: rounded up (a delivery never leaves before its due time),
    at least one, at most the ladder's longest (a longer one comes back early and the
    consumer parks it for the rest)."""
    units = math.ceil(round(remaining_seconds * 1000 / UNIT_MS, 6))
    return max(1, min(units, _LONGEST_UNITS))


def digits(units: int) -> list[int]:
    """The wait's digits in base BASE, lowest level first."""
    out = []
    while units:
        units, digit = divmod(units, BASE)
        out.append(digit)
    return out


def route(namespace: str, remaining_seconds: float) -> tuple[str, dict[str, str]]:
    """Where a delivery due in ``remaining_seconds`` enters the ladder (the exchange of its
    wait's highest nonzero digit), and its routing headers: one per level from there down."""
    wait = digits(units_for(remaining_seconds))
    headers = {_HEADER.format(level=level): str(digit) for level, digit in enumerate(wait)}
    return exchange_name(namespace, len(wait) - 1), headers


async def declare(channel: AbstractChannel, namespace: str, work: AbstractExchange) -> None:
    """Declare the ladder, lowest level first (each level passes on to the one below).

    Idempotent. A queue whose node is down keeps its exchange and its "0" route; a
    delivery that needs that queue is then unroutable, and the publisher falls back to
    the delay tiers.
    """
    below = work
    for level in range(LEVELS):
        header = _HEADER.format(level=level)
        decide = await channel.declare_exchange(
            exchange_name(namespace, level), aio_pika.ExchangeType.HEADERS, durable=True
        )
        for digit in range(1, BASE):
            queue = await brokers.declare_classic(
                channel,
                queue_name(namespace, level, digit),
                {
                    "x-queue-type": "classic",
                    "x-message-ttl": digit * level_ms(level),
                    "x-dead-letter-exchange": below.name,
                },
            )
            if queue is not None:  # None: its node is down (bound when it was declared)
                await queue.bind(decide, arguments={"x-match": "all", header: str(digit)})
        await below.bind(decide, arguments={"x-match": "all", header: "0"})
        below = decide
