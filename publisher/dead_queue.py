"""One bounded read of the dead-letter queue: the loop ``relay replay --from queue`` and
``relay replay --from queue --drop`` share.

The read takes its bound when it begins (the queue's length then) and stops at the first
letter dead-lettered after that moment, so beside running consumers it never judges the
dead letters its own replays produce. Letters the caller does not settle stay unacked
until the read ends, so ``basic.get`` cannot hand one out twice, and are then returned.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from service import amqp
from service.progress import Progress


class DeadLetterRead:
    """``async for letter in read.letters()``; ``hold`` what stays; ``close`` at the end."""

    def __init__(self, queue: AbstractQueue, *, limit: int, progress: str) -> None:
        self._queue = queue
        self.bound = min(limit, queue.declaration_result.message_count or 0)
        self._started_ms = int(time.time() * 1000)
        self._held: list[AbstractIncomingMessage] = []
        self._progress = Progress(progress)
        self._read = 0

    async def letters(self) -> AsyncIterator[AbstractIncomingMessage]:
        """The letters that were in the queue when the read began, at most ``bound``."""
        while self._read < self.bound:
            message = await self._queue.get(no_ack=False, fail=False)
            if message is None:
                return
            dead_at = (message.headers or {}).get(amqp.DEAD_AT_HEADER)
            if isinstance(dead_at, int) and dead_at > self._started_ms:
                self._held.append(message)  # newer than this read: not ours to judge
                return
            self._read += 1
            self._progress.update(self._read, self.bound)
            yield message

    def hold(self, message: AbstractIncomingMessage) -> None:
        """Leave ``message`` in the queue: returned, unacked, when the read ends."""
        self._held.append(message)

    async def close(self) -> None:
        self._progress.finish()
        for message in self._held:
            await message.nack(requeue=True)
