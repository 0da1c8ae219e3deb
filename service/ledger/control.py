"""Operator transitions: steer one publish run (hold, release, cancel, dead-letter), cancel
a reminder, reopen occurrences skipped while admission was paused (backfill), and skip
admitted occurrences an edit of their reminder's schedule no longer owes.

Each transition is a named conditional statement of ``sql/queries.sql`` that locks rows
in id order, and each run action is written in the same transaction as the record of who
did it, when, why and to how many rows (``run_actions``).

A cancel or dead-letter reaches rows already claimed. A claimed row not past its last
check (``service.ledger.lastcheck``) is moved at once, and its consumer's last check, which
locks the same row, finds it moved and sends nothing. A row past its last check may be
on the wire: it is marked so that it is never sent again, and ``settle`` waits for its
outcome and then moves it too if it came back to be retried. When ``settle`` returns with
none unsettled, nothing of the run is being sent or will be sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from service.db import q
from service.ledger.model import Connection, Executor, State, operator_dead_error

ACTIONS = ("hold", "release", "cancel", "dead-letter")
STOPS = ("cancel", "dead-letter")  # the actions that end a run's rows
_POLL_SECONDS = 0.1
# How long a cancel or dead-letter waits for the requests it found on the wire, beyond
# one request's timeout: the consumer's outcome write after the answer.
WIRE_WAIT_MARGIN_SECONDS = 5.0


def wire_wait_seconds(http_timeout_seconds: float) -> float:
    """How long ``settle`` waits, for consumers whose requests time out after this."""
    return http_timeout_seconds + WIRE_WAIT_MARGIN_SECONDS


@dataclass(frozen=True)
class RunState:
    """What an action on a run would touch."""

    run_id: int
    held: bool
    movable: int  # pending, queued or retrying: an action moves these
    claimed: int  # sending, not past the last check: a cancel stops them before the request
    on_the_wire: int  # sending, past the last check: their request may be on its way

    @property
    def in_flight(self) -> int:
        return self.claimed + self.on_the_wire


@dataclass(frozen=True)
class ActionResult:
    """What an action did (or, in a dry run, would do)."""

    run_id: int
    action: str
    applied: bool
    changed: bool  # False: it was already so (idempotent), nothing recorded
    rows: int  # moved (cancel, dead-letter: claimed_stopped among them)
    # hold, release: rows claimed now. cancel, dead-letter: rows whose request may still
    # be on the wire when the action returned (their outcome is not known yet)
    in_flight: int
    claimed_stopped: int = 0  # claimed rows stopped before their request (never sent)
    on_the_wire: int = 0  # past their last check at the action's commit
    wire_outcomes: dict[str, int] | None = None  # what became of those (None: not waited)
    waited_seconds: float | None = None
    action_id: int | None = field(default=None, repr=False)
    wire: tuple[tuple[int, int], ...] = field(default=(), repr=False)  # (id, attempt)

    def as_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        del data["action_id"], data["wire"]
        return data


async def run_state(executor: Executor, run_id: int) -> RunState | None:
    """The run's hold and its movable rows, or None if there is no such run."""
    run = await executor.fetchrow(q("run_exists"), run_id)
    if run is None:
        return None
    counts = await executor.fetchrow(q("run_open_counts"), run_id)
    assert counts is not None
    return RunState(
        run_id,
        run["held_at"] is not None,
        counts["movable"],
        counts["claimed"],
        counts["on_the_wire"],
    )


def _would_change(action: str, state: RunState) -> int:
    """Rows the action would move (hold/release: the rows it would stop or free)."""
    if action == "hold":
        return 0 if state.held else state.movable + state.in_flight
    if action == "release":
        return state.movable + state.in_flight if state.held else 0
    return state.movable + state.claimed


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
    there is no such run. Doing it twice changes nothing the second time. A cancel or
    dead-letter that found rows on the wire returns them: ``settle`` waits for them."""
    if action not in ACTIONS:
        raise ValueError(f"unknown run action {action!r}")
    async with conn.transaction():
        state = await run_state(conn, run_id)
        if state is None:
            return None
        if action in STOPS:
            return await _stop(conn, state, action, operator, reason, apply)
        would = _would_change(action, state)
        changed = state.held != (action == "hold")
        if not apply or not changed:
            return ActionResult(run_id, action, apply, changed, would, state.in_flight)
        await _hold_or_release(conn, run_id, action)
        await conn.fetchrow(q("run_action_record"), run_id, action, operator, reason, would)
    return ActionResult(run_id, action, True, True, would, state.in_flight)


async def _hold_or_release(conn: Connection, run_id: int, action: str) -> None:
    if action == "hold":
        await conn.fetchval(q("run_hold"), run_id)
        return
    await conn.fetchval(q("run_release"), run_id)
    # Rows parked while held are due again at once (their parked messages claim them).
    await conn.fetch(q("run_release_parked"), run_id)


async def _stop(
    conn: Connection,
    state: RunState,
    action: str,
    operator: str,
    reason: str | None,
    apply: bool,
) -> ActionResult:
    """Cancel or dead-letter: move what is not on the wire, mark what is (one statement)."""
    run_id = state.run_id
    would = state.movable + state.claimed
    changed = would > 0 or state.on_the_wire > 0
    if not apply or not changed:
        return ActionResult(
            run_id,
            action,
            apply,
            changed,
            would,
            state.on_the_wire,
            claimed_stopped=state.claimed,
            on_the_wire=state.on_the_wire,
        )
    record = q("run_action_record")
    action_id = int(await conn.fetchval(record, run_id, action, operator, reason, 0))
    moved, claimed, wire = await _stop_rows(conn, run_id, action, action_id, reason)
    await conn.execute(q("run_action_counts"), action_id, moved, claimed, len(wire), None)
    return ActionResult(
        run_id,
        action,
        True,
        True,
        moved,
        len(wire),
        claimed_stopped=claimed,
        on_the_wire=len(wire),
        action_id=action_id,
        wire=wire,
    )


async def _stop_rows(
    conn: Connection, run_id: int, action: str, action_id: int, reason: str | None
) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """run_stop: (rows moved, of them claimed, (id, attempt) of the rows on the wire)."""
    error = operator_dead_error(reason)
    rows = await conn.fetch(q("run_stop"), run_id, action, action_id, error)
    moved = [r for r in rows if not r["on_the_wire"]]
    claimed = sum(1 for r in moved if r["prior_state"] == State.SENDING)
    wire = tuple((r["id"], r["attempts"]) for r in rows if r["on_the_wire"])
    return len(moved), claimed, wire


async def settle(
    conn: Connection,
    result: ActionResult,
    *,
    reason: str | None,
    wait_seconds: float,
    monotonic: Callable[[], float] = time.monotonic,
) -> ActionResult:
    """Wait, at most ``wait_seconds``, until every row a cancel or dead-letter found on the
    wire has an outcome; then end those that came back to be retried (their request failed)
    as the action says, and record what became of them. ``in_flight`` of the answer: rows
    still without an outcome (their request may be answered yet; none is sent again)."""
    if not result.wire or result.action_id is None:
        return result
    started = monotonic()
    pending = dict(result.wire)
    while True:
        for r in await conn.fetch(q("run_wire_states"), list(pending)):
            if not (r["state"] == State.SENDING and r["attempts"] == pending[r["id"]]):
                del pending[r["id"]]
        if not pending or monotonic() - started >= wait_seconds:
            break
        await asyncio.sleep(_POLL_SECONDS)
    async with conn.transaction():
        moved, claimed, _ = await _stop_rows(
            conn, result.run_id, result.action, result.action_id, reason
        )
        now = await conn.fetch(q("run_wire_states"), [i for i, _ in result.wire])
        outcomes = Counter(State(r["state"]) for r in now)
        settled = dataclasses.replace(
            result,
            rows=result.rows + moved,
            claimed_stopped=result.claimed_stopped + claimed,
            in_flight=outcomes.get(State.SENDING, 0),
            wire_outcomes={str(k): v for k, v in sorted(outcomes.items())},
            waited_seconds=round(monotonic() - started, 3),
        )
        await conn.execute(
            q("run_action_counts"),
            result.action_id,
            settled.rows,
            settled.claimed_stopped,
            settled.on_the_wire,
            settled.wire_outcomes,
        )
    return settled


@dataclass(frozen=True)
class RunAction:
    """One recorded operator action on a run."""

    run_id: int
    action: str
    operator: str
    reason: str | None
    rows: int
    claimed_stopped: int
    on_the_wire: int
    wire_outcomes: dict[str, int] | None
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


async def cancel_reminder(executor: Executor, reminder_id: str) -> bool:
    """An operator's cancel: no new occurrences, and its queued sends are skipped at send
    time (the consumer reads it again right before each request). Recorded as
    ``cancelled``, so enabling its destination never revives it. False if there is no such
    reminder or it already was cancelled."""
    return await executor.fetchval(q("cancel_reminder"), reminder_id) is not None
