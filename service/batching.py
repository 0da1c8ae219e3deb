"""Group calls made close together into one database round trip.

A consumer finishes hundreds of deliveries a second; one transaction per claim or per
outcome caps it near the single-connection commit rate. ``Batcher`` collects what
concurrent tasks submit while earlier batches are in flight, and runs each group as one
call (one statement over arrays), up to ``max_concurrent`` groups at once.

One bad item must not fail its neighbours: when a group fails, each of its items is run
again on its own, so only the item that really fails sees the error. An ``Abandoned``
error (the process is stopping, a server stays unreachable) is not the items' fault and
fails the whole group at once.

A ``linger`` makes a batch that is not full wait that long for company before it goes
(less, if it fills meanwhile):
at a trickle (deliveries falling due one by one, 1,000 a second) every claim and outcome
would otherwise be a round trip of its own, and the consumer spent twice the CPU per
delivery that it does in a drain (``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from service.errors import Abandoned

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
        linger_seconds: float = 0.0,
    ) -> None:
        self._flush = flush
        self._max_size = max_size
        self._linger = linger_seconds
        self._slots = asyncio.Semaphore(max_concurrent)
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()  # a whole batch is waiting: a linger ends early
        self._running: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._refusal: Abandoned | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def submit(self, item: T) -> R:
        if self._refusal is not None:
            raise self._refusal
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._wakeup.set()
        if len(self._pending) >= self._max_size:
            self._full.set()
        return await future

    def stop_intake(self, reason: str) -> None:
        """Refuse new items and fail those not yet flushed; groups in flight finish."""
        self._refusal = Abandoned(reason)
        pending, self._pending = self._pending, []
        for _, future in pending:
            if not future.done():
                future.set_exception(self._refusal)

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            # Wait for a free slot first: while every slot is busy, the batch keeps growing.
            await self._slots.acquire()
            await asyncio.sleep(0)  # let submitters woken in this tick join the batch
            if self._linger and len(self._pending) < self._max_size:
                # A trickle: wait for company, until the batch is full at the latest.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._linger):
                        await self._full.wait()
            batch = self._pending[: self._max_size]
            del self._pending[: self._max_size]
            if len(self._pending) < self._max_size:
                self._full.clear()
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
            await self._flush_group(batch)
        except asyncio.CancelledError:
            # Cancelled at shutdown, possibly half way through a one-by-one fallback:
            # whoever still waits learns that the work was given up.
            _fail(batch, Abandoned("batch cancelled at shutdown"))
            raise
        finally:
            self._slots.release()

    async def _flush_group(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._flush([item for item, _ in batch])
        except Abandoned as exc:
            _fail(batch, exc)
        except Exception as exc:
            if len(batch) == 1:
                _fail(batch, exc)
            else:
                await self._one_by_one(batch)
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    async def _one_by_one(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        for item, future in batch:
            try:
                (result,) = await self._flush([item])
            except Exception as exc:
                _fail([(item, future)], exc)
            else:
                if not future.done():
                    future.set_result(result)

    async def close(self, timeout_seconds: float) -> None:
        """Flush what was submitted, within the deadline; then cancel what is left."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_seconds):
                while self._pending or self._running:
                    await asyncio.sleep(0.01)
        self.stop_intake("closed")
        tasks = [t for t in (self._loop_task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _fail(batch: Sequence[tuple[object, asyncio.Future[R]]], exc: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
