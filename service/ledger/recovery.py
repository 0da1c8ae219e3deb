"""Recovery's statements on the ledger: which rows' messages are presumed lost.

Two passes republish a message the broker lost, both from the ledger: rescue, at the end
of every publish run, for any open row long overdue (``RELAY_RESCUE_AFTER_SECONDS``); and
each consumer's overdue sweep, every few seconds, for a queued row not claimed shortly
after it was due (``RELAY_OVERDUE_AFTER_SECONDS``): a message lost from the timer ladder.
Neither changes a row's state: each stamps what it republished, so repeated passes move
on to other rows, and the claim makes a republished message whose original also arrives
a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.db import q
from service.ledger.model import Executor, retry_on_conflict


async def select_rescue(
    executor: Executor, overdue_seconds: float, limit: int
) -> list[tuple[int, bool]]:
    """Rows whose message is presumed lost (see the query), oldest overdue first."""
    rows = await executor.fetch(q("select_rescue"), overdue_seconds, limit)
    return [(r["id"], r["urgent"]) for r in rows]


async def mark_rescued(executor: Executor, ids: Sequence[int]) -> None:
    """Stamp rows whose rescue publish was confirmed; rescue skips them for an interval."""
    if ids:
        await retry_on_conflict(lambda: executor.execute(q("mark_rescued"), list(ids)))


async def overdue_exists(executor: Executor, after_seconds: float) -> bool:
    """Whether some queued row is overdue for the sweep (see ``stamp_overdue``)."""
    return bool(await executor.fetchval(q("overdue_exists"), after_seconds))


@dataclass(frozen=True)
class Overdue:
    """Rows a sweep stamped: (id, urgent) of each, and how many of them a sweep had
    already republished since their last publication (that copy did not come either)."""

    rows: list[tuple[int, bool]]
    copies_unclaimed: int


async def stamp_overdue(executor: Executor, after_seconds: float, limit: int) -> Overdue:
    """Stamp up to ``limit`` queued rows not claimed ``after_seconds`` after they were due
    (or published) as republished, oldest due first. Concurrent callers get different
    rows."""
    rows = await executor.fetch(q("stamp_overdue"), after_seconds, limit)
    return Overdue(
        [(r["id"], r["urgent"]) for r in rows], sum(1 for r in rows if r["copy_unclaimed"])
    )


async def open_owed_count(executor: Executor) -> int:
    """Rows whose message should be in a queue now (queued, sending, retrying)."""
    return int(await executor.fetchval(q("open_owed_count")))
