"""Operator transitions over deliveries: steer one publish run (hold, release, cancel,
dead-letter), reopen occurrences skipped while admission was paused (backfill), and skip
admitted occurrences an edit of their reminder's schedule no longer owes.

Part of the one door to delivery state, beside ``service.ledger``: each transition is a
named conditional statement of ``sql/queries.sql`` that locks rows in id order, and each
run action is written in the same transaction as the record of who did it, when, why and
to how many rows (``run_actions``). A row a consumer holds right now (``sending``) is
never moved: its request may be on its way; the action reports it as in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from service.db import q
from service.ledger import Connection, Executor, State

ACTIONS = ("hold", "release", "cancel", "dead-letter")


@dataclass(frozen=True)
class RunState:
    """What an action on a run would touch."""

    run_id: int
    held: bool
    movable: int  # pending, queued or retrying: an action moves these
    in_flight: int  # sending: left alone


@dataclass(frozen=True)
class ActionResult:
    """What an action did (or, in a dry run, would do)."""

    run_id: int
    action: str
    applied: bool
    changed: bool  # False: it was already so (idempotent), nothing recorded
    rows: int
    in_flight: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def run_state(executor: Executor, run_id: int) -> RunState | None:
    """The run's hold and its movable rows, or None if there is no such run."""
    run = await executor.fetchrow(q("run_exists"), run_id)
    if run is None:
        return None
    counts = await executor.fetchrow(q("run_open_counts"), run_id)
    assert counts is not None
    return RunState(run_id, run["held_at"] is not None, counts["movable"], counts["in_flight"])


def _would_change(action: str, state: RunState) -> int:
    """Rows the action would move (hold/release: the rows it would stop or free)."""
    if action == "hold":
        return 0 if state.held else state.movable + state.in_flight
    if action == "release":
        return state.movable + state.in_flight if state.held else 0
    return state.movable


async def act_on_run(
    conn: Connection,
    run_id: int,
    action: str,
    *,
    operator: str,
    reason: str | None,
    apply: bool,
) -> ActionResult | None:
    """Hold, release, cancel or dead-letter one run (a dry run unless ``apply``); None if
    there is no such run. Doing it twice changes nothing the second time."""
    if action not in ACTIONS:
        raise ValueError(f"unknown run action {action!r}")
    async with conn.transaction():
        state = await run_state(conn, run_id)
        if state is None:
            return None
        would = _would_change(action, state)
        changed = (action in ("hold", "release") and (state.held != (action == "hold"))) or (
            action in ("cancel", "dead-letter") and would > 0
        )
        if not apply or not changed:
            return ActionResult(run_id, action, apply, changed, would, state.in_flight)
        rows = await _transition(conn, run_id, action, reason or "")
        if action in ("hold", "release"):
            rows = would
        await conn.fetchrow(q("run_action_record"), run_id, action, operator, reason, rows)
    return ActionResult(run_id, action, True, True, rows, state.in_flight)


async def _transition(conn: Connection, run_id: int, action: str, reason: str) -> int:
    if action == "hold":
        await conn.fetchval(q("run_hold"), run_id)
        return 0
    if action == "release":
        await conn.fetchval(q("run_release"), run_id)
        # Rows parked while held are due again at once (their parked messages claim them).
        return len(await conn.fetch(q("run_release_parked"), run_id))
    if action == "cancel":
        return len(await conn.fetch(q("run_cancel"), run_id))
    return len(await conn.fetch(q("run_dead_letter"), run_id, reason or "no reason"))


@dataclass(frozen=True)
class RunAction:
    """One recorded operator action on a run."""

    run_id: int
    action: str
    operator: str
    reason: str | None
    rows: int
    at: datetime


async def actions_of(executor: Executor, run_ids: Sequence[int]) -> list[RunAction]:
    """The recorded actions on these runs, oldest first."""
    rows = await executor.fetch(q("run_actions_of"), list(run_ids))
    return [RunAction(**dict(r)) for r in rows]


async def existing_keys(executor: Executor, keys: Sequence[str]) -> dict[str, tuple[State, str]]:
    """key -> (state, skip reason or '') of the rows the ledger already has for ``keys``."""
    rows = await executor.fetch(q("deliveries_by_keys"), list(keys))
    return {r["idempotency_key"]: (State(r["state"]), r["skip_reason"] or "") for r in rows}


async def reopen_paused(
    conn: Connection, keys: Sequence[str], run_id: int
) -> list[tuple[int, bool, datetime]]:
    """skipped ('paused') -> pending, as rows of the backfill run ``run_id``; returns
    (id, urgent, occurrence_at) of the rows reopened. Any other row is left alone."""
    if not keys:
        return []
    rows = await conn.fetch(q("reopen_paused"), list(keys), run_id)
    return [(r["id"], r["urgent"], r["occurrence_at"]) for r in rows]


async def skip_rescheduled(conn: Connection, ids: Sequence[int]) -> list[int]:
    """pending/queued/retrying -> skipped ('rescheduled'), in the transaction of the edit
    that stopped owing them; returns the ids skipped (a row claimed meanwhile is not)."""
    if not ids:
        return []
    return [r["id"] for r in await conn.fetch(q("skip_rescheduled"), list(ids))]


async def delivery_for_drop(executor: Executor, delivery_id: int) -> asyncpg.Record | None:
    """What ``relay replay --drop`` matches a dead letter's delivery against."""
    row: asyncpg.Record | None = await executor.fetchrow(q("delivery_for_drop"), delivery_id)
    return row


async def drop_finished(executor: Executor, audit_id: int, selected: int, dropped: int) -> None:
    """Record how a drop of dead letters ended (in ``replays``, source ``drop``)."""
    await executor.execute(q("replay_dropped"), audit_id, selected, dropped)
