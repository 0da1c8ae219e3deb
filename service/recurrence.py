"""Recurring wall-clock rules as instants: the DST arithmetic behind ``service.schedule``.

A recurring schedule is a :data:`Rule` -- a daily local wall-clock time or a 5-field cron
expression -- read in an IANA time zone. This module turns a rule into streams of
timezone-aware UTC instants, through spring-forward gaps and fall-back overlaps:

* :func:`instants_after`: the instants strictly after a given one, increasing;
* :func:`instants_at_or_before`: the instants at or before a given one, decreasing.

It is pure and trusts its input: ``service.schedule`` validates a schedule (zone, daily
time, cron syntax) before it asks for instants. The rules are documented, with examples,
in ``docs/schedules.md`` ("Wall time to UTC").
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from typing import TypeAlias
from zoneinfo import ZoneInfo

from croniter import (  # type: ignore[import-untyped,unused-ignore]
    CroniterBadDateError,
    croniter,
)

# A daily local wall-clock time (minute resolution, no tzinfo), or a 5-field cron
# expression in local time.
Rule: TypeAlias = time | str

_ONE_US = timedelta(microseconds=1)
_ONE_S = timedelta(seconds=1)


# A rule is a sequence of local wall times. Mapping wall times to instants with _to_utc
# is non-decreasing (a gap sends several wall times to one transition instant; an overlap
# uses only the first pass), so walking the wall times in order and dropping any instant
# not strictly beyond the last one yields a strictly increasing, duplicate-free sequence
# of instants.
#
# Where to start walking, going forward from instant `after`: a wall time w <= wall(after)
# always maps to an instant <= after, so starting just after wall(after) is enough.
# Going backward from instant `at`: if `at` is in the second pass of an overlap, wall
# times up to the end of the overlap map to the first pass (before `at`), so the walk
# starts that much later in wall time.


def instants_after(rule: Rule, tz: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """Instants of ``rule`` in ``tz`` strictly after ``after`` (UTC), strictly increasing."""
    last = after
    for wall in _walls_forward(rule, after.astimezone(tz).replace(tzinfo=None)):
        occ = _to_utc(wall, tz)
        if occ > last:
            yield occ
            last = occ


def instants_at_or_before(rule: Rule, tz: ZoneInfo, at: datetime) -> Iterator[datetime]:
    """Instants of ``rule`` in ``tz`` at or before ``at`` (UTC), strictly decreasing."""
    local = at.astimezone(tz)
    start = local.replace(tzinfo=None)
    if local.fold:
        # Second pass of an overlap: wall times up to the overlap's end (earlier by the
        # size of the shift) already fired during the first pass.
        first_pass = local.replace(fold=0).utcoffset()
        second_pass = local.utcoffset()
        assert first_pass is not None and second_pass is not None
        start += max(first_pass - second_pass, timedelta(0))
    last = at + _ONE_US
    for wall in _walls_backward(rule, start):
        occ = _to_utc(wall, tz)
        if occ < last:
            yield occ
            last = occ


# ------------------------------------------------------------------ wall times of a rule


def _walls_forward(rule: Rule, start: datetime) -> Iterator[datetime]:
    """Naive local wall times of the rule, increasing, all >= the date of ``start``."""
    if isinstance(rule, time):
        at = rule.replace(fold=0)
        day = start.date()
        while True:
            yield datetime.combine(day, at)
            if day == date.max:
                return
            day += timedelta(days=1)
    it = croniter(rule, start - _ONE_US)  # get_next is strict: include `start`
    while True:
        try:
            yield it.get_next(datetime)
        except CroniterBadDateError:  # ran off the end of the calendar
            return


def _walls_backward(rule: Rule, start: datetime) -> Iterator[datetime]:
    """Naive local wall times of the rule, decreasing, all <= ``start``."""
    if isinstance(rule, time):
        at = rule.replace(fold=0)
        day = start.date()
        while True:
            wall = datetime.combine(day, at)
            if wall <= start:
                yield wall
            if day == date.min:
                return
            day -= timedelta(days=1)
    it = croniter(rule, start + _ONE_US)  # get_prev is strict: include `start`
    while True:
        try:
            yield it.get_prev(datetime)
        except CroniterBadDateError:
            return


# ------------------------------------------------------------------ wall time -> UTC


def _to_utc(wall: datetime, tz: ZoneInfo) -> datetime:
    """Map a naive local wall time to the instant it fires at.

    * exists once  -> that instant;
    * exists twice (fall-back overlap) -> the first, earlier instant (fold=0);
    * does not exist (spring-forward gap) -> the transition instant, i.e. the first valid
      instant after the gap (02:30 Europe/Berlin on a spring-forward day -> 03:00 CEST).
    """
    utc = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if utc.astimezone(tz).replace(tzinfo=None) == wall:
        return utc
    return _gap_transition(wall, tz)


def _gap_transition(wall: datetime, tz: ZoneInfo) -> datetime:
    # In a gap, fold=0/1 interpret the wall time with the offsets in force before/after
    # the transition; the transition instant lies between the two readings. zoneinfo
    # has no public "transitions" API, so binary-search it: before the transition every
    # instant reads as a wall time before `wall`, from the transition on, after it.
    # TZif transitions fall on whole UTC seconds, so searching whole seconds is exact.
    a = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    b = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    lo, hi = min(a, b), max(a, b)

    def after_gap(t: datetime) -> bool:
        return t.astimezone(tz).replace(tzinfo=None) > wall

    if after_gap(lo) or not after_gap(hi):  # pragma: no cover - not a simple gap
        return hi
    lo_s, hi_s = 0, int((hi - lo) // _ONE_S)  # after_gap(lo + lo_s) False, (lo + hi_s) True
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if after_gap(lo + mid * _ONE_S):
            hi_s = mid
        else:
            lo_s = mid
    return lo + hi_s * _ONE_S
