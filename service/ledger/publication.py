"""Publication: what a confirmed publish writes. The pending sweep of a publish run (and
a backfill, a replay) pages through ``pending`` rows, publishes their messages and marks
the ones the broker confirmed ``queued`` (``pending -> queued``); a row whose publish was
not confirmed stays ``pending`` for the next run. Rescue and the overdue sweep, which
republish rows already queued, are ``service.ledger.recovery``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from service.db import q
from service.ledger.model import Executor, retry_on_conflict


async def mark_queued(executor: Executor, ids: Sequence[int]) -> None:
    """pending -> queued, for ids whose publish the broker confirmed."""
    if ids:
        await retry_on_conflict(lambda: executor.execute(q("mark_queued"), list(ids)))


async def select_pending(
    executor: Executor, after_id: int, limit: int
) -> list[tuple[int, bool, datetime]]:
    """A page of pending rows (id, urgent, occurrence_at) after ``after_id``."""
    rows = await executor.fetch(q("select_pending"), after_id, limit)
    return [(r["id"], r["urgent"], r["occurrence_at"]) for r in rows]
