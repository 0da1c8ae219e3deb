"""The overdue sweep: each consumer republishes queued rows whose message has not come.

A delivery admitted ahead waits in the broker's timer ladder (``service/timer.py``):
classic queues, not replicated, whose dead-lettering is at-most-once. Its message can be
lost (the node holding the ladder gone, a message dropped between two levels, a purge)
while its row stays ``queued``. Rescue would republish it ``RELAY_RESCUE_AFTER_SECONDS``
(15 min) later; this sweep does it within seconds. Every ``RELAY_OVERDUE_SWEEP_SECONDS``,
in every replica:

1. a cheap indexed check for a queued row not claimed ``RELAY_OVERDUE_AFTER_SECONDS``
   after it was due (the usual answer: none, and the pass ends there);
2. as rescue does, republish no more than the queues lack (rows owed minus messages ready
   in the lanes, the ladder and the delay tiers), so a backlog, where every message is
   still waiting, gets no copies piled behind its originals;
3. stamp the rows in one statement (SKIP LOCKED: replicas take different rows, and a
   stamped row is left alone for one interval), then publish each straight to its lane,
   confirmed.

A copy whose original arrives too is harmless: whichever comes second finds its row
claimed or final (``relay.overdue.duplicates`` counts those).

A row stamped again whose earlier copy did not reach a consumer either, while nothing is
ready in the lanes (no backlog it could wait behind), means the lanes do not deliver to
this session: RabbitMQ 3.10, when a lane queue was deleted and declared
again at once (a publish run declares the topology every run), sent no ``basic.cancel``
and kept handing the new queue's messages to the old consumer, which never got them. The
sweep then ends the session (``on_unclaimed``) after publishing the copies: the channel
closing gives back what it held, and the next session consumes again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiormq
import asyncpg

from service import logs, publishing
from service.ledger import recovery
from service.telemetry import Metrics

log = logs.get("consumer")


@dataclass(frozen=True)
class OverdueSweep:
    """One consumer's sweep; ``count_waiting`` counts the messages ready in the queues,
    ``count_lanes_ready`` those in the lanes alone."""

    pool: asyncpg.Pool
    publisher: publishing.ConfirmedPublisher
    count_waiting: Callable[[], Awaitable[int]]
    count_lanes_ready: Callable[[], Awaitable[int]]
    metrics: Metrics
    after_seconds: float
    limit: int
    on_unclaimed: Callable[[], None] = lambda: None

    async def once(self) -> int:
        """One pass; how many rows it republished."""
        if not await recovery.overdue_exists(self.pool, self.after_seconds):
            return 0
        room = await recovery.open_owed_count(self.pool) - await self.count_waiting()
        if room <= 0:
            log.debug(
                "overdue rows, but the queues hold every owed message",
                extra={"event": "overdue_capped"},
            )
            return 0
        overdue = await recovery.stamp_overdue(self.pool, self.after_seconds, min(room, self.limit))
        if not overdue.rows:
            return 0  # another replica took them
        # Stamped first, so that no other replica copies them too; a publish that fails
        # here leaves its row to a pass one interval later.
        confirmed, failed = await self.publisher.publish_many(overdue.rows)
        self.metrics.overdue_republished.add(len(confirmed))
        log.warning(
            "republished queued deliveries whose message did not come",
            extra={
                "event": "overdue_republished",
                "republished": len(confirmed),
                "failed": len(failed),
                "after_seconds": self.after_seconds,
            },
        )
        # Nothing ready in the lanes: the copies were not waiting behind a backlog.
        if overdue.copies_unclaimed and not await self.count_lanes_ready():
            log.error(
                "copies republished earlier did not reach a consumer either: consuming again",
                extra={"event": "lanes_not_delivering", "rows": overdue.copies_unclaimed},
            )
            self.on_unclaimed()
        return len(confirmed)


async def run_sweep(sweep: OverdueSweep, interval_seconds: float) -> None:
    """Sweep now and every ``interval_seconds`` after; a failed pass is logged and the
    next one tries again."""
    while True:
        try:
            await sweep.once()
        except (OSError, TimeoutError, asyncpg.PostgresError, aiormq.exceptions.AMQPError) as exc:
            log.warning(
                "overdue sweep failed",
                extra={"event": "overdue_sweep_failed", "error": type(exc).__name__},
            )
        await asyncio.sleep(interval_seconds)
