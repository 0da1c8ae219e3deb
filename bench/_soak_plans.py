"""The hot queries of ``retention_soak.py`` and the arguments it explains them with: the
consumer's claim and outcome write, the publish run's pending page and its confirm, the
status report's reads, and the purge's own picks. Each is the named block of
``service/sql/queries.sql``, explained (not run) with ``EXPLAIN (FORMAT JSON)``."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import _retention as ret
import asyncpg

from service import db

EPOCH = datetime.min.replace(tzinfo=UTC)


def _complete_args(ids: list[int], now: datetime) -> tuple[Any, ...]:
    """The 17 arrays of ``complete``: each row delivered on its first attempt."""
    n = len(ids)
    return (
        ids, [1] * n, ["delivered"] * n, [None] * n, [200] * n, [None] * n, [None] * n,
        [None] * n, ["accepted"] * n, [50.0] * n, [None] * n, ['{"ok":true}'] * n,
        [None] * n, [now] * n, [False] * n, [None] * n, [None] * n,
    )  # fmt: skip


def queries(ids: list[int], run_id: int, as_of: datetime, rows_days: int) -> dict[str, tuple]:
    """name -> arguments; ``ids`` the newest deliveries, ``run_id`` the newest run."""
    cutoff = as_of - timedelta(days=rows_days)
    return {
        "claim": (ids, 300.0),
        "complete": _complete_args(ids, as_of),
        "select_pending": (0, 500),
        "mark_queued": (ids,),
        "overall_state_counts": (),
        "oldest_claimable_age": (),
        "outbox_state_counts": (False,),
        "run_state_counts": ([run_id],),
        "run_lateness": ([run_id],),
        "run_missing": (run_id, 100),
        "runs_recent": (None, 20, None, False),
        "purge_content_pick": ("webhook", cutoff, cutoff, EPOCH, 0, 5000),
        "purge_rows_pick": ("webhook", cutoff, cutoff, EPOCH, 0, cutoff, 5000),
    }


async def capture(
    conn: asyncpg.Connection, ids: list[int], run_id: int, as_of: datetime, rows_days: int
) -> dict[str, list[str]]:
    """name -> node types of its plan (a block this tree does not have is left out)."""
    blocks = db.queries()
    out: dict[str, list[str]] = {}
    for name, args in queries(ids, run_id, as_of, rows_days).items():
        if name in blocks:
            out[name] = await ret.plan_of(conn, blocks[name], *args)
    return out


def compare(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    """One line per query: the same plan (node types, relations and indexes), or the
    nodes that went and came."""
    lines = []
    for name, nodes in before.items():
        later = after.get(name, [])
        if nodes == later:
            lines.append(f"   {name}: same ({' > '.join(nodes[:3])}{' ...' * (len(nodes) > 3)})")
            continue
        gone = Counter(nodes) - Counter(later)
        came = Counter(later) - Counter(nodes)
        change = "; ".join(
            [f"- {n}" for n in gone.elements()] + [f"+ {n}" for n in came.elements()]
        )
        lines.append(f"   {name}: CHANGED: {change or 'same nodes, another order'}")
    return lines
