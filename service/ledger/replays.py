"""Replay: dead (or other) rows back into the pipeline for another round of attempts
(``dead -> pending``), selected from the ledger by a filter or named by the dead letters
of the queue, and the record of each replay and each drop of dead letters (``replays``:
who, from where, with which filters, how it ended). A replayed row starts a new round
(``round_start``), so the attempt policy counts afresh; a delivered row is never reset.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from service.db import q
from service.ledger.model import Executor, State, retry_on_conflict


async def reset_for_replay(executor: Executor, ids: Sequence[int]) -> list[tuple[int, bool]]:
    """dead -> pending for another round of attempts; (id, urgent) of the rows reset."""
    if not ids:
        return []
    rows = await retry_on_conflict(lambda: executor.fetch(q("reset_for_replay"), list(ids)))
    return [(r["id"], r["urgent"]) for r in rows]


@dataclass(frozen=True)
class ReplayFilter:
    """Which rows a ledger replay selects (None: any)."""

    states: tuple[State, ...] = (State.DEAD,)
    since: datetime | None = None
    until: datetime | None = None
    run_id: int | None = None
    reminder_id: str | None = None
    provider: str | None = None
    channel: str | None = None
    key: str | None = None
    last_status: int | None = None


async def select_for_replay(
    executor: Executor, selection: ReplayFilter, after_id: int, limit: int
) -> list[tuple[int, State, bool]]:
    """One page (id, state, urgent) of rows matching ``selection``, after ``after_id``."""
    f = selection
    filters = (f.since, f.until, f.run_id, f.reminder_id, f.provider, f.channel, f.key)
    states = [s.value for s in f.states]
    rows = await executor.fetch(
        q("replay_select"), states, *filters, f.last_status, after_id, limit
    )
    return [(r["id"], State(r["state"]), r["urgent"]) for r in rows]


@contextlib.asynccontextmanager
async def recorded(
    pool: asyncpg.Pool, source: str, operator: str, filters: dict[str, Any]
) -> AsyncIterator[int]:
    """Record who started a replay (or a drop), from where and with which filters; its id.

    Until the ``async with`` ends, a pooled connection of its own holds a lock on that id,
    so that a replay killed before it recorded its end is told from one still running
    (``console_replays_recent``). Its release unlocks it: asyncpg resets a connection's
    advisory locks when it returns to the pool.
    """
    async with pool.acquire() as holder:
        yield int(await holder.fetchval(q("replay_started"), source, operator, filters))


async def replay_progress(
    executor: Executor, replay_id: int, selected: int, replayed: int, dropped: int = 0
) -> None:
    """Record what a replay (or drop) has done so far (its counts if it is killed)."""
    await executor.execute(q("replay_progress"), replay_id, selected, replayed, dropped)


async def replay_finished(
    executor: Executor, replay_id: int, selected: int, replayed: int, *, interrupted: bool
) -> None:
    """Record how a replay ended (``interrupted``: stopped by a signal, counts so far)."""
    await executor.execute(q("replay_finished"), replay_id, selected, replayed, interrupted)


async def state_of(executor: Executor, delivery_id: int) -> tuple[State, bool] | None:
    """(state, urgent) of one row, or None if there is no such row."""
    row = await executor.fetchrow(q("delivery_lane"), delivery_id)
    return None if row is None else (State(row["state"]), row["urgent"])


async def delivery_for_drop(executor: Executor, delivery_id: int) -> asyncpg.Record | None:
    """What ``relay replay --drop`` matches a dead letter's delivery against."""
    row: asyncpg.Record | None = await executor.fetchrow(q("delivery_for_drop"), delivery_id)
    return row


async def drop_finished(
    executor: Executor, audit_id: int, selected: int, dropped: int, *, interrupted: bool
) -> None:
    """Record how a drop of dead letters ended (in ``replays``, source ``drop``)."""
    await executor.execute(q("replay_dropped"), audit_id, selected, dropped, interrupted)
