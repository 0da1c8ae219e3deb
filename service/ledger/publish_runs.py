"""Publish runs' records (``publish_runs``): a run is recorded when it starts
(``running``) and finished once with its counts; the CHECK constraint ties
``finished_at`` to the status, and finishing a run that is no longer ``running`` changes
nothing. While a run runs, a session of its own holds a lock on its id (``RunLock``): a
run still ``running`` without it was killed, and the next run marks it ``interrupted``.
A run's hold and release are operator actions (``service.ledger.control``); its report is
read by ``service.runs``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType

import asyncpg

from service import logs
from service.db import q
from service.ledger.model import Connection, Executor

log = logs.get("publisher")


@dataclass(frozen=True)
class Started:
    """A run just recorded as ``running``."""

    run_id: int
    started_at: datetime  # the database's clock


async def start(holder: Connection, kind: str, intended_fire_at: datetime, host: str) -> Started:
    """Record a new ``running`` run of ``kind`` (``publish``, ``rescue`` or ``backfill``),
    after marking ``interrupted`` every run whose process is gone.

    ``holder``'s session locks the run's id: keep it out of the pool until ``unlock``, so
    that the run counts as alive exactly as long as its process does.
    """
    for dead in await holder.fetch(q("runs_interrupted")):
        log.warning(
            "an earlier run ended without recording its end; marked interrupted",
            extra={"event": "run_interrupted", "run_id": dead["id"]},
        )
    row = await holder.fetchrow(q("start_run"), kind, intended_fire_at, host)
    assert row is not None  # an INSERT ... RETURNING always returns its row
    return Started(run_id=row["id"], started_at=row["started_at"])


async def unlock(holder: Connection, run_id: int) -> None:
    """The run is over: ``holder`` may go back to the pool."""
    await holder.execute(q("run_unlock"), run_id)


class RunLock:
    """A run's liveness: the session lock on its id, on a pooled connection held from
    ``start`` to the end of the ``async with``.

    That connection can be lost while the run goes on with its others: its backend
    terminated, an idle-session timeout (it sits idle for the whole run), a proxy that cut
    it. The lock goes with it, and a run starting meanwhile marks this one
    ``interrupted``. ``keep``, called between batches and before the run's end is
    recorded, takes the lock again on a new connection and records the run ``running``
    again, so its end is its own.
    """

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._holder: asyncpg.pool.PoolConnectionProxy | None = None
        self._lost = False
        self.run_id: int | None = None

    async def __aenter__(self) -> RunLock:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._holder is None:
            return
        try:
            if self.run_id is not None and not self._lost:
                # A connection gone took its lock along: its error is not the run's.
                with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    await unlock(self._holder, self.run_id)
        finally:
            await self._let_go()

    async def start(self, kind: str, intended_fire_at: datetime, host: str) -> Started:
        """Record the run (``start``) on the held connection, which then holds its lock."""
        started = await start(await self._hold(), kind, intended_fire_at, host)
        self.run_id = started.run_id
        return started

    async def keep(self) -> None:
        """If the lock's connection was lost, take the lock again on another."""
        if not self._lost or self.run_id is None:
            return
        await self._let_go()
        row = await (await self._hold()).fetchrow(q("run_relock"), self.run_id)
        assert row is not None  # a SELECT without FROM returns its one row
        log.warning(
            "the run's lock connection was lost; lock taken again",
            extra={"event": "run_lock_retaken", "run_id": self.run_id, "revived": row["revived"]},
        )

    async def _hold(self) -> asyncpg.pool.PoolConnectionProxy:
        holder = await self._pool.acquire()
        holder.add_termination_listener(self._on_lost)
        self._holder, self._lost = holder, False
        return holder

    def _on_lost(self, _connection: object) -> None:
        self._lost = True

    async def _let_go(self) -> None:
        holder, self._holder = self._holder, None
        if holder is None:
            return
        # Lost, its proxy no longer answers (the pool took the connection back).
        with contextlib.suppress(asyncpg.InterfaceError):
            holder.remove_termination_listener(self._on_lost)
        await self._pool.release(holder)  # a lost one is already out of use: a no-op


async def finish(
    executor: Executor,
    run_id: int,
    status: str,
    *,
    due: int,
    created: int,
    skipped: int,
    published: int,
    rescued: int,
    failed: int,
    error: str | None,
) -> bool:
    """running -> ``status`` with the run's counts; False if it was already finished."""
    result = await executor.execute(
        q("finish_run"),
        run_id,
        status,
        due,
        created,
        skipped,
        published,
        rescued,
        failed,
        error,
    )
    return result == "UPDATE 1"


async def record_published(executor: Executor, run_id: int, published: int, failed: int) -> None:
    """A finished run that published afterwards (a backfill with --publish): its counts."""
    await executor.execute(q("run_published_count"), run_id, published, failed)
