"""Reminder schedules: when does a reminder fire?

This module owns the calendar arithmetic of reminder-relay and nothing else:

* validating a :class:`Schedule` (time zone, kind-specific fields, cron syntax);
* turning a schedule into occurrences -- instants computed in the reminder's own IANA
  time zone (wall-clock rules, including DST gaps and overlaps) and returned as
  timezone-aware UTC datetimes;
* deciding, for a reminder that has fallen due, which owed occurrences to send and which
  to record as skipped (:func:`plan_due`), according to the missed-run policy.

The wall-clock arithmetic itself (a daily time or a cron expression in a zone, through
DST gaps and overlaps, as UTC instants) is in ``service.recurrence``; this module is the
door to it and the only module that validates.

It is pure: no I/O of its own, no global clock (the current time is always an argument)
and no mutable state. The only outside data is the IANA database read by ``zoneinfo``.
The rules are documented, with examples, in ``docs/schedules.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from functools import lru_cache
from typing import Any, Literal, Protocol, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import (  # type: ignore[import-untyped,unused-ignore]
    CroniterBadDateError,
    croniter,
)

from service import recurrence

ScheduleKind = Literal["once", "daily", "cron"]
MissedPolicy = Literal["catch_up", "latest", "skip"]

_KINDS: tuple[str, ...] = get_args(ScheduleKind)
_POLICIES: tuple[str, ...] = get_args(MissedPolicy)

# Reasons attached to skipped occurrences in Plan.skipped.
SKIP_MISSED = "missed"
SKIP_CATCH_UP_LIMIT = "catch_up_limit"
# Summary entry: stands for every owed occurrence older than the oldest one listed
# individually (see MAX_OWED_LISTED); its datetime is the oldest owed occurrence.
SKIP_TRUNCATED = "truncated"

# plan_due looks at no more than this many owed occurrences (the newest ones), so a
# minutely cron whose publisher was down for weeks costs bounded time and memory.
MAX_OWED_LISTED = 1_000

_ONE_US = timedelta(microseconds=1)


@dataclass(frozen=True)
class Schedule:
    """When a reminder fires. Exactly the field matching ``kind`` must be set."""

    kind: ScheduleKind
    timezone: str = "UTC"  # IANA name
    due_at: datetime | None = None  # kind == "once": aware datetime
    daily_at: time | None = None  # kind == "daily": local wall-clock time
    cron: str | None = None  # kind == "cron": 5-field cron expression in local time


class ScheduleError(ValueError):
    """A schedule (or an argument about one) is invalid; the message names the problem."""


@dataclass(frozen=True)
class Plan:
    """What the publisher should do with a reminder that has fallen due."""

    send: list[datetime]  # occurrences to create deliveries for, increasing
    skipped: list[tuple[datetime, str]]  # (occurrence, reason), increasing
    next_due_at: datetime | None  # next occurrence strictly after now (None: finished)


# --------------------------------------------------------------------------- validation


class Row(Protocol):
    """Anything indexable by column name (an asyncpg Record, a dict)."""

    def __getitem__(self, key: str) -> Any: ...


def from_row(row: Row) -> Schedule:
    """The schedule of a ``reminders`` row (columns schedule_kind, timezone, due_at,
    daily_at, cron)."""
    return Schedule(
        kind=row["schedule_kind"],
        timezone=row["timezone"],
        due_at=row["due_at"],
        daily_at=row["daily_at"],
        cron=row["cron"],
    )


def parse_daily_at(text: str) -> time:
    """Parse a 24-hour ``"HH:MM"`` string (e.g. ``"06:00"``, ``"23:59"``)."""
    if not isinstance(text, str):
        raise ScheduleError(f"daily_at must be HH:MM, got {text!r}")
    hh, sep, mm = text.partition(":")
    # Exactly two ASCII digits each side: rejects "6:00", "06:00:00", " 06:00", non-ASCII digits.
    if (
        sep != ":"
        or len(hh) != 2
        or len(mm) != 2
        or not (hh + mm).isascii()
        or not (hh + mm).isdigit()
    ):
        raise ScheduleError(f"daily_at must be HH:MM, got {text!r}")
    hour, minute = int(hh), int(mm)
    if hour > 23 or minute > 59:
        raise ScheduleError(f"daily_at must be HH:MM (00:00-23:59), got {text!r}")
    return time(hour, minute)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first problem found; return None if valid."""
    if schedule.kind not in _KINDS:
        raise ScheduleError(
            f"unknown schedule kind {schedule.kind!r} (expected one of {', '.join(_KINDS)})"
        )
    _zone(schedule.timezone)

    # The field for the kind must be set and the others must not: a daily reminder that
    # also carries a cron expression is ambiguous, and guessing would hide a caller bug.
    fields = {"once": "due_at", "daily": "daily_at", "cron": "cron"}
    for kind, field in fields.items():
        value = getattr(schedule, field)
        if kind == schedule.kind and value is None:
            raise ScheduleError(f"{field} is required for a {kind!r} schedule")
        if kind != schedule.kind and value is not None:
            raise ScheduleError(f"{field} must not be set for a {schedule.kind!r} schedule")

    if schedule.kind == "once":
        due_at = schedule.due_at
        if not isinstance(due_at, datetime):
            raise ScheduleError(f"due_at must be a datetime, got {type(due_at).__name__}")
        if due_at.utcoffset() is None:
            raise ScheduleError("due_at must be timezone-aware (got a naive datetime)")
    elif schedule.kind == "daily":
        daily_at = schedule.daily_at
        # datetime is not a subclass of time, so this also rejects datetimes.
        if not isinstance(daily_at, time):
            raise ScheduleError(f"daily_at must be HH:MM, got {daily_at!r}")
        if daily_at.tzinfo is not None:
            raise ScheduleError(
                "daily_at must be HH:MM local wall-clock time without tzinfo "
                "(the zone comes from Schedule.timezone)"
            )
        # Minute resolution, like cron; keeps DST arithmetic and storage simple.
        if daily_at.second or daily_at.microsecond:
            raise ScheduleError(f"daily_at must be HH:MM (no seconds), got {daily_at!r}")
    else:
        _check_cron(schedule.cron)


def _zone(name: object) -> ZoneInfo:
    if not isinstance(name, str):
        raise ScheduleError(f"time zone must be an IANA name string, got {name!r}")
    # "localtime" resolves to whatever the host is configured with: not a stable IANA zone.
    if name == "localtime":
        raise ScheduleError(f"unknown time zone {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        # ValueError: malformed keys ("", "../x", "/abs"); OSError: directories ("America").
        raise ScheduleError(f"unknown time zone {name!r}") from exc


def _check_cron(expr: object) -> None:
    if not isinstance(expr, str):
        raise ScheduleError(f"cron must be a string, got {type(expr).__name__}")
    fields = expr.split()
    # croniter also accepts seconds/years fields and "@daily"-style aliases; the stored
    # format is plain 5-field cron so every consumer of the column can read it.
    if len(fields) != 5:
        raise ScheduleError(
            f"bad cron expression {expr!r}: expected 5 fields "
            f"(minute hour day-of-month month day-of-week), got {len(fields)}"
        )
    _check_cron_fires(expr)


# Parsing a cron expression costs about a millisecond and every public function validates
# its schedule, so remember the expressions already found good. Pure memoisation: the
# answer depends only on the string; failures raise and are not cached.
@lru_cache(maxsize=4096)
def _check_cron_fires(expr: str) -> None:
    try:
        it = croniter(expr, datetime(2000, 1, 1))
    except Exception as exc:  # CroniterBadCronError, or other types on odd input
        raise ScheduleError(f"bad cron expression {expr!r}: {exc}") from exc
    try:
        it.get_next(datetime)
    except CroniterBadDateError as exc:  # e.g. "0 0 30 2 *" (30 February)
        raise ScheduleError(f"bad cron expression {expr!r}: it never fires") from exc


def _require_aware(name: str, value: object) -> datetime:
    if not isinstance(value, datetime):
        raise ScheduleError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.utcoffset() is None:
        raise ScheduleError(f"{name} must be timezone-aware (got a naive datetime)")
    return value.astimezone(UTC)


# ------------------------------------------------------------------ occurrence streams


def _iter_after(schedule: Schedule, after: datetime) -> Iterator[datetime]:
    """Occurrences strictly after ``after`` (UTC), strictly increasing."""
    if schedule.kind == "once":
        assert schedule.due_at is not None
        due = schedule.due_at.astimezone(UTC)
        if due > after:
            yield due
        return
    yield from recurrence.instants_after(_rule(schedule), _zone(schedule.timezone), after)


def _iter_at_or_before(schedule: Schedule, at: datetime) -> Iterator[datetime]:
    """Occurrences at or before ``at`` (UTC), strictly decreasing."""
    if schedule.kind == "once":
        assert schedule.due_at is not None
        due = schedule.due_at.astimezone(UTC)
        if due <= at:
            yield due
        return
    yield from recurrence.instants_at_or_before(_rule(schedule), _zone(schedule.timezone), at)


def _rule(schedule: Schedule) -> recurrence.Rule:
    """The wall-clock rule of a recurring (daily or cron) schedule."""
    rule = schedule.daily_at if schedule.kind == "daily" else schedule.cron
    assert rule is not None
    return rule


def _first(it: Iterator[datetime]) -> datetime | None:
    return next(it, None)


# ------------------------------------------------------------------------ public API


def first_occurrence(schedule: Schedule, not_before: datetime) -> datetime | None:
    """Earliest occurrence at or after ``not_before``, as UTC.

    For a "once" schedule this is ``due_at`` itself even if it is earlier than
    ``not_before``: a one-shot reminder created late still fires, the caller decides.
    None only if a recurring schedule has no further occurrence in the calendar.
    """
    validate(schedule)
    not_before = _require_aware("not_before", not_before)
    if schedule.kind == "once":
        assert schedule.due_at is not None
        return schedule.due_at.astimezone(UTC)
    return _first(_iter_after(schedule, not_before - _ONE_US))


def next_occurrence_after(schedule: Schedule, after: datetime) -> datetime | None:
    """First occurrence strictly after ``after``, as UTC; None when there is none more."""
    validate(schedule)
    return _first(_iter_after(schedule, _require_aware("after", after)))


def occurrences(schedule: Schedule, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """Occurrences with ``start <= occ <= end``, strictly increasing, at most ``limit``."""
    validate(schedule)
    start = _require_aware("start", start)
    end = _require_aware("end", end)
    if limit < 0:
        raise ScheduleError(f"limit must be >= 0, got {limit}")
    result: list[datetime] = []
    if limit == 0 or end < start:
        return result
    for occ in _iter_after(schedule, start - _ONE_US):
        if occ > end:
            break
        result.append(occ)
        if len(result) >= limit:
            break
    return result


def plan_due(
    schedule: Schedule,
    next_due_at: datetime,
    now: datetime,
    policy: MissedPolicy,
    misfire_grace: timedelta,
    catch_up_limit: int,
    *,
    horizon: datetime | None = None,
) -> Plan:
    """Decide what to send for a reminder whose stored ``next_due_at`` has been reached
    (or will be by ``horizon``, a look-ahead: occurrences in ``(now, horizon]`` are owed
    too, always on time, and are sent at their due time).

    Owed occurrences are those in ``[next_due_at, now]``. One is *on time* if
    ``now - occ <= misfire_grace`` and *missed* otherwise. Policies:

    * ``catch_up``: send every owed occurrence, but only the newest ``catch_up_limit``;
      older ones are skipped with reason ``"catch_up_limit"``.
    * ``latest``: send only the newest owed occurrence; the rest are skipped ``"missed"``.
    * ``skip``: send the on-time ones; missed ones are skipped ``"missed"``.

    Every owed occurrence ends up in ``send`` or ``skipped``, except that only the newest
    :data:`MAX_OWED_LISTED` are listed one by one: if there are more, the older ones
    are represented by a single ``(oldest owed occurrence, "truncated")`` entry at the
    start of ``skipped``. ``next_due_at`` of the result is the first occurrence strictly
    after the horizon (``now`` without one). Called early (stored ``next_due_at`` after
    the horizon), nothing is owed and the stored value is returned unchanged.
    """
    validate(schedule)
    stored = _require_aware("next_due_at", next_due_at)
    now = _require_aware("now", now)
    until = max(_require_aware("horizon", horizon), now) if horizon is not None else now
    _check_missed_policy(policy, misfire_grace, catch_up_limit)
    if stored > until:
        return Plan(send=[], skipped=[], next_due_at=stored)

    owed, truncated = _owed(schedule, stored, until)
    # The missed-fire policy judges what is already due; what falls due within the
    # look-ahead is on time by definition.
    upcoming = [occ for occ in owed if occ > now]
    send, skipped = _apply_policy(
        owed[: len(owed) - len(upcoming)], now, policy, misfire_grace, catch_up_limit
    )
    send += upcoming
    if truncated:
        oldest = _first(_iter_after(schedule, stored - _ONE_US))
        assert oldest is not None and (not owed or oldest < owed[0])
        skipped.insert(0, (oldest, SKIP_TRUNCATED))
    return Plan(send=send, skipped=skipped, next_due_at=_first(_iter_after(schedule, until)))


def _check_missed_policy(policy: object, misfire_grace: object, catch_up_limit: object) -> None:
    if policy not in _POLICIES:
        raise ScheduleError(
            f"unknown missed policy {policy!r} (expected one of {', '.join(_POLICIES)})"
        )
    if not isinstance(misfire_grace, timedelta) or misfire_grace < timedelta(0):
        raise ScheduleError(f"misfire_grace must be a timedelta >= 0, got {misfire_grace!r}")
    if isinstance(catch_up_limit, bool) or not isinstance(catch_up_limit, int):
        raise ScheduleError(f"catch_up_limit must be an int >= 0, got {catch_up_limit!r}")
    if catch_up_limit < 0:
        raise ScheduleError(f"catch_up_limit must be >= 0, got {catch_up_limit}")


def _owed(schedule: Schedule, stored: datetime, now: datetime) -> tuple[list[datetime], bool]:
    """Owed occurrences in ``[stored, now]``, increasing: the newest :data:`MAX_OWED_LISTED`,
    and whether older ones were left out."""
    # Walk back from `now` so that, however long the outage, only the newest
    # MAX_OWED_LISTED occurrences are ever materialised.
    newest_first: list[datetime] = []
    for occ in _iter_at_or_before(schedule, now):
        if occ < stored:
            break
        if len(newest_first) == MAX_OWED_LISTED:
            return newest_first[::-1], True
        newest_first.append(occ)
    return newest_first[::-1], False


def _apply_policy(
    owed: list[datetime],
    now: datetime,
    policy: MissedPolicy,
    misfire_grace: timedelta,
    catch_up_limit: int,
) -> tuple[list[datetime], list[tuple[datetime, str]]]:
    """Split the owed occurrences into (to send, skipped with a reason) by ``policy``."""
    if policy == "catch_up":
        cut = max(len(owed) - catch_up_limit, 0)
        return owed[cut:], [(occ, SKIP_CATCH_UP_LIMIT) for occ in owed[:cut]]
    if policy == "latest":
        return owed[-1:], [(occ, SKIP_MISSED) for occ in owed[:-1]]
    send = [occ for occ in owed if now - occ <= misfire_grace]
    skipped = [(occ, SKIP_MISSED) for occ in owed if now - occ > misfire_grace]
    return send, skipped
