"""The ledger: the one door to delivery state.

Every named statement of ``sql/queries.sql`` that writes ``deliveries``,
``delivery_attempts``, ``publish_runs`` or their records (``run_actions``, ``replays``)
is run from a module of this package, one typed function per transition over one
guarded statement: its ``WHERE`` is the state machine, and a transition that finds its
row in another state does nothing and says so (an empty result), because "someone else
won" is a normal answer in a system with redelivery and rescue. Other modules may read
through named queries; ``tests/unit/test_ledger_door.py`` holds the line.

This module is the package's vocabulary (``service.ledger.model``, re-exported: the
states, the rows, the connection types); each concern is a module of its own:

* ``sending``: claim, give back, write an attempt's outcome, confirm a dead letter
* ``lastcheck``: the last check before a request
* ``publication``: the pending sweep's page, and ``pending -> queued`` once a publish is confirmed
* ``recovery``: rescue and the overdue sweep (which rows' messages are presumed lost, stamped)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.db import q
from service.ledger.model import (
    FINAL_STATES,
    OPEN_STATES,
    Attempt,
    Claimed,
    Completion,
    Connection,
    Executor,
    SendFacts,
    State,
    Target,
    Unclaimable,
    operator_dead_error,
    outbox_key,
    retry_on_conflict,
    send_facts,
)

__all__ = [
    "FINAL_STATES",
    "OPEN_STATES",
    "Attempt",
    "Claimed",
    "Completion",
    "Connection",
    "Executor",
    "SendFacts",
    "State",
    "Target",
    "Unclaimable",
    "operator_dead_error",
    "outbox_key",
    "retry_on_conflict",
    "send_facts",
]


async def cancel_reminder(executor: Executor, reminder_id: str) -> bool:
    """An operator's cancel: no new occurrences, and its queued sends are skipped at send
    time (the consumer reads it again right before each request). Recorded as
    ``cancelled``, so enabling its destination never revives it. False if there is no such
    reminder or it already was cancelled."""
    return await executor.fetchval(q("cancel_reminder"), reminder_id) is not None


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


async def replay_started(
    executor: Executor, source: str, operator: str, filters: dict[str, Any]
) -> int:
    """Record who started a replay, from where and with which filters; its id."""
    return int(await executor.fetchval(q("replay_started"), source, operator, filters))


async def replay_finished(executor: Executor, replay_id: int, selected: int, replayed: int) -> None:
    """Record how a replay ended."""
    await executor.execute(q("replay_finished"), replay_id, selected, replayed)


async def state_of(executor: Executor, delivery_id: int) -> tuple[State, bool] | None:
    """(state, urgent) of one row, or None if there is no such row."""
    row = await executor.fetchrow(q("delivery_lane"), delivery_id)
    return None if row is None else (State(row["state"]), row["urgent"])
