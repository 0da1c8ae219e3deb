"""Publish runs' records (``publish_runs``): a run is recorded when it starts
(``running``) and finished once with its counts; the CHECK constraint ties
``finished_at`` to the status, and finishing a run that is no longer ``running`` changes
nothing. While a run runs, the connection that started it holds a lock on its id: a run
still ``running`` without it was killed, and the next run marks it ``interrupted``. A
run's hold and release are operator actions (``service.ledger.control``); its report is
read by ``service.runs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

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
