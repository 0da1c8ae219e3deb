"""Acknowledging settled messages in groups, as the broker allows: one
``basic.ack(multiple=True)`` for every settled message up to the lowest one still open.

A consumer settles hundreds of messages a second, mostly in the order they arrived (their
outcomes are written in groups). One ack frame per message is a frame to build, queue and
parse on both sides; one frame per run of settled messages is most of that saved. A
message still being worked (a slow receiver, a budget wait) holds back the run behind it,
so settled messages past it are acknowledged one by one instead: the prefetch window
never waits on a slow neighbour.

Only what the worker has decided (settled by ``consumer/settle.py``) is acknowledged, and
only after the outcome is durable, exactly as before: grouping changes how many frames
carry the acks, not when a message may be acked. Nacks and anything else go through the
message itself.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable

from service import logs

log = logs.get("consumer")

# (delivery tag, multiple): the channel's basic.ack.
AckFrame = Callable[[int, bool], Awaitable[None]]


class GroupedAcks:
    """One per consume channel. ``opened`` when a message arrives; ``ack`` once it is
    settled; ``dropped`` when it was settled another way (nack, channel closed)."""

    def __init__(self, send: AckFrame) -> None:
        self._send = send
        self._open: list[int] = []  # heap of tags delivered and not yet settled
        self._gone: set[int] = set()  # settled tags still in the heap (lazy removal)
        self._settled: list[int] = []  # acked, not yet sent
        self._flush: asyncio.Task[None] | None = None

    def opened(self, tag: int) -> None:
        heapq.heappush(self._open, tag)

    def dropped(self, tag: int) -> None:
        self._gone.add(tag)

    def ack(self, tag: int) -> None:
        """Acknowledge ``tag`` with the next frame (this tick or the next)."""
        self._gone.add(tag)
        self._settled.append(tag)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._send_settled())

    async def close(self) -> None:
        """Wait for the acks already settled to go out (the session closes the channel
        next); a failed send was logged, and the broker redelivers those messages."""
        if self._flush is not None:
            await asyncio.gather(self._flush, return_exceptions=True)

    def _lowest_open(self) -> int | None:
        while self._open and self._open[0] in self._gone:
            self._gone.discard(heapq.heappop(self._open))
        return self._open[0] if self._open else None

    async def _send_settled(self) -> None:
        await asyncio.sleep(0)  # let the other messages settled in this tick join
        try:
            await self._send_all()
        except Exception as exc:  # the channel is gone: the broker redelivers them all
            log.warning("acks not sent", extra={"event": "ack_failed", "error": type(exc).__name__})

    async def _send_all(self) -> None:
        while self._settled:
            settled, self._settled = sorted(self._settled), []
            lowest = self._lowest_open()
            below = [t for t in settled if lowest is None or t < lowest]
            if below:
                await self._send(below[-1], True)  # every tag up to it is settled
            for tag in settled[len(below) :]:
                await self._send(tag, False)
