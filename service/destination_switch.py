"""An operator's switch of a webhook destination: disable, and enable with a dry run.

Disabling holds the destination's deliveries and pauses its active reminders
(``service.destinations.disable``). Enabling (:func:`enable`) undoes only that, in one
transaction:

* it resumes the reminders its disable (or a 410) paused, never one an operator cancelled
  (``service.reminder_state``);
* it settles the destination's deliveries that are neither final nor in flight (held):
  one whose reminder was cancelled is skipped ``cancelled``, one older than its reminder's
  ``stale_after`` (without ``send_stale``) is skipped ``stale``, the others are sent (the
  parked ones are due at once): ``service.ledger.switches``;
* it leaves each resumed reminder's ``next_due_at`` where the pause stopped it, so the
  next publish run treats what fell due meanwhile exactly as missed fires: the reminder's
  ``missed_policy`` (and admission's pause windows) say which occurrences are sent and
  which are skipped, and the consumer skips the ones past ``stale_after`` at send time.

A dry run (``apply`` False) runs the same statements with their writes turned off and
counts with the publisher's rule (``schedule.plan_due``), so its numbers are what the
apply does, but for rows a consumer claims in between and occurrences that fall due (or
turn missed) before the next publish run. The CLI (``relay destinations``) and the console
both call this module, and check their input with the same functions (:func:`target`,
:func:`reason_of`). An applied switch that changed something is recorded in
``destination_actions`` (who, when, why, what it did).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from service import destinations, entry, errors, netpolicy, runs, schedule
from service.db import q
from service.ledger import switches
from service.settings import Settings

MAX_REASON_CHARS = 200
MAX_OPERATOR_CHARS = 200


class SwitchRefused(errors.InputError):
    """A switch refused before anything was done; the message says why (the CLI exits 2,
    the console answers 400)."""


def target(url: str, allow: netpolicy.AllowList) -> str:
    """The destination a switch acts on: a webhook URL the destination policy accepts,
    normalised."""
    problem = entry.destination_problem("webhook", url, allow)
    if problem is not None:
        raise SwitchRefused(f"URL refused: {problem}")
    return destinations.normalise(url)


def reason_of(reason: str | None, *, apply: bool, operator: str = "operator") -> str:
    """The operator's reason, stripped: required to apply, at most MAX_REASON_CHARS; and
    the operator's name must be recordable."""
    if not 1 <= len(operator.strip()) <= MAX_OPERATOR_CHARS:
        raise SwitchRefused(f"the operator's name: 1 to {MAX_OPERATOR_CHARS} characters")
    text = (reason or "").strip()
    if apply and not text:
        raise SwitchRefused("say why: a reason is recorded with the action")
    if len(text) > MAX_REASON_CHARS:
        raise SwitchRefused(f"the reason is longer than {MAX_REASON_CHARS} characters")
    return text


@dataclass(frozen=True)
class MissedFire:
    """The publisher's missed-fire settings, which the count of owed occurrences uses."""

    grace_seconds: float
    catch_up_limit: int

    @classmethod
    def of(cls, settings: Settings) -> MissedFire:
        """From RELAY_MISFIRE_GRACE_SECONDS and RELAY_CATCH_UP_LIMIT."""
        return cls(settings.misfire_grace_seconds, settings.catch_up_limit)


@dataclass(frozen=True)
class Owed:
    """What the next publish run does with the occurrences resumed reminders owe now."""

    send: int = 0  # admitted to be sent
    stale: int = 0  # admitted, but already past stale_after: skipped 'stale' at send time
    skipped: int = 0  # recorded skipped: missed, catch_up_limit, truncated, paused


@dataclass(frozen=True)
class Enabling:
    """What enabling a destination does (a dry run) or did (applied)."""

    url: str
    applied: bool
    changed: bool  # False: it was not disabled; nothing to do, nothing done
    reminders_resumed: int = 0
    reminders_cancelled: int = 0  # cancelled by an operator: they stay cancelled
    held_send: int = 0  # held deliveries sent (the parked ones due at once)
    held_stale: int = 0  # held deliveries past stale_after: skipped 'stale'
    held_cancelled: int = 0  # held deliveries of cancelled reminders: skipped 'cancelled'
    occurrences_send: int = 0
    occurrences_stale: int = 0
    occurrences_skipped: int = 0

    def effect(self) -> dict[str, int]:
        """The counts alone (as recorded in destination_actions)."""
        return {k: v for k, v in asdict(self).items() if k not in ("url", "applied", "changed")}

    def as_dict(self) -> dict[str, Any]:
        """The JSON form the CLI prints and the console answers."""
        return {
            "url": self.url,
            "apply": self.applied,
            "changed": self.changed,
            "enabled": self.applied and self.changed,
            **self.effect(),
        }


def owed_occurrences(
    rows: Sequence[asyncpg.Record | dict[str, Any]],
    now: datetime,
    missed: MissedFire,
    paused: Sequence[tuple[datetime, datetime]] = (),
) -> Owed:
    """Count what the publisher's plan (``schedule.plan_due``, then admission's pause
    windows ``paused``) makes of the occurrences these reminders owe by ``now``. Pure."""
    send = stale = skipped = 0
    grace = timedelta(seconds=missed.grace_seconds)
    for row in rows:
        if row["next_due_at"] is None:
            continue
        try:
            plan = schedule.plan_due(
                schedule.from_row(row),
                row["next_due_at"],
                now,
                row["missed_policy"],
                grace,
                missed.catch_up_limit,
            )
        except schedule.ScheduleError:
            continue  # the publisher stops such a reminder (schedule_invalid): nothing owed
        skipped += len(plan.skipped)
        for at in plan.send:
            if runs.in_pause(at, paused):
                skipped += 1
            elif _stale(row, at, now):
                stale += 1
            else:
                send += 1
    return Owed(send, stale, skipped)


def _stale(row: asyncpg.Record | dict[str, Any], at: datetime, now: datetime) -> bool:
    limit = row["stale_after_seconds"]
    return limit is not None and not row["send_stale"] and (now - at).total_seconds() > limit


async def enable(
    conn: destinations.Connection,
    url: str,
    *,
    now: datetime,
    missed: MissedFire,
    apply: bool,
    operator: str,
    reason: str,
) -> Enabling | None:
    """Enable a disabled destination (a dry run unless ``apply``), as the module says;
    None if there is no such destination. ``now`` is the time the owed occurrences are
    counted at (the publisher's clock)."""
    reason = reason_of(reason, apply=apply, operator=operator)
    async with conn.transaction():
        state = await conn.fetchval(q("destination_lock_state"), url)
        if state is None:
            return None
        if state != "disabled":
            return Enabling(url, apply, changed=False)
        paused = await conn.fetch(q("enable_resume_reminders"), url, apply)
        cancelled = int(await conn.fetchval(q("destination_cancelled_reminders"), url))
        held = await switches.settle_held(conn, url, apply)
        since = min((r["next_due_at"] for r in paused if r["next_due_at"]), default=now)
        owed = owed_occurrences(paused, now, missed, await runs.pause_windows(conn, since))
        result = Enabling(
            url,
            apply,
            changed=True,
            reminders_resumed=len(paused),
            reminders_cancelled=cancelled,
            held_send=held.send,
            held_stale=held.stale,
            held_cancelled=held.cancelled,
            occurrences_send=owed.send,
            occurrences_stale=owed.stale,
            occurrences_skipped=owed.skipped,
        )
        if apply:
            await conn.fetchval(q("enable_destination"), url)
            await _record(conn, url, "enable", operator, reason, result.effect())
    return result


async def disable(
    conn: destinations.Connection, url: str, *, operator: str, reason: str
) -> destinations.Disabled:
    """An operator's disable (registering the URL if need be): its deliveries are held and
    its reminders paused; recorded when it changed anything."""
    reason = reason_of(reason, apply=True, operator=operator)
    async with conn.transaction():
        done = await destinations.disable(conn, url, f"operator: {reason}")
        if done.destination_id is not None or done.reminders_paused:
            effect = {"reminders_paused": done.reminders_paused}
            await _record(conn, url, "disable", operator, reason, effect)
    return done


def disabled_dict(url: str, done: destinations.Disabled) -> dict[str, Any]:
    """The JSON form of a disable the CLI prints and the console answers."""
    return {
        "url": url,
        "disabled": True,
        "changed": done.destination_id is not None,
        "reminders_paused": done.reminders_paused,
    }


async def _record(
    conn: destinations.Connection,
    url: str,
    action: str,
    operator: str,
    reason: str,
    effect: dict[str, int],
) -> None:
    await conn.execute(q("destination_action_record"), url, action, operator, reason, effect)


@dataclass(frozen=True)
class Action:
    """One recorded operator action on a destination."""

    action: str
    operator: str
    reason: str
    effect: dict[str, int]
    at: datetime


async def actions_of(executor: destinations.Executor, url: str, limit: int = 10) -> list[Action]:
    """The latest recorded actions on this destination, newest first."""
    rows = await executor.fetch(q("destination_actions_of"), url, limit)
    return [Action(**dict(r)) for r in rows]
