"""Group calls made close together into one database round trip.

A consumer finishes hundreds of deliveries a second; one transaction per claim or per
outcome caps it near the single-connection commit rate. ``Batcher`` collects what
concurrent tasks submit while earlier batches are in flight, and runs each group as one
call (one statement over arrays), up to ``max_concurrent`` groups at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """``await submit(item)`` returns that item's result from ``flush(items)``."""

    def __init__(
        self,
        flush: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        max_size: int,
        max_concurrent: int,
    ) -> None:
        self._flush = flush
        self._max_size = max_size
        self._slots = asyncio.Semaphore(max_concurrent)
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._wakeup = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._wakeup.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            # Wait for a free slot first: while every slot is busy, the batch keeps growing.
            await self._slots.acquire()
            await asyncio.sleep(0)  # let submitters woken in this tick join the batch
            batch = self._pending[: self._max_size]
            del self._pending[: self._max_size]
            if not self._pending:
                self._wakeup.clear()
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._flush([item for item, _ in batch])
        except Exception as exc:  # every waiter learns of the failure
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        finally:
            self._slots.release()

    async def close(self) -> None:
        """Stop taking batches once what was submitted has been flushed."""
        while self._pending or self._running:
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
