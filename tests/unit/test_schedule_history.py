"""Unit tests for service.schedule_history: which occurrences a reminder owed, piecewise
over its schedule versions. Pure: no I/O, no clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.schedule import Schedule, occurrences, parse_daily_at
from service.schedule_history import Owed, Version, owed_between, owes


def utc(day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0) -> datetime:
    return datetime(2026, 3, day, hour, minute, second, us, tzinfo=UTC)


def daily(at: str, zone: str = "UTC") -> Schedule:
    return Schedule(kind="daily", timezone=zone, daily_at=parse_daily_at(at))


def once(at: datetime) -> Schedule:
    return Schedule(kind="once", due_at=at)


def instants(found: list[Owed]) -> list[datetime]:
    return [o.at for o in found]


# ------------------------------------------------------------------ examples


def test_a_single_version_owes_what_its_schedule_has() -> None:
    s = daily("06:00", "Europe/Berlin")
    found = owed_between([Version(s)], utc(1), utc(10), 100)
    assert instants(found) == occurrences(s, utc(1), utc(10), 100)
    assert {o.schedule for o in found} == {s}


def test_moved_from_0600_to_0700_owes_0600_before_the_change_and_0700_from_it() -> None:
    changed = utc(4, 12)
    versions = [Version(daily("06:00"), None, changed), Version(daily("07:00"), changed)]
    found = owed_between(versions, utc(2), utc(6, 23), 100)
    assert instants(found) == [utc(2, 6), utc(3, 6), utc(4, 6), utc(5, 7), utc(6, 7)]
    assert [o.schedule.daily_at for o in found] == [parse_daily_at("06:00")] * 3 + [
        parse_daily_at("07:00")
    ] * 2


def test_an_occurrence_at_the_change_instant_belongs_to_the_new_version() -> None:
    changed = utc(4, 6)  # 06:00 exactly: the old schedule no longer owes it
    versions = [Version(daily("06:00"), None, changed), Version(daily("07:00"), changed)]
    assert instants(owed_between(versions, utc(3), utc(4, 23), 100)) == [utc(3, 6), utc(4, 7)]
    assert not owes(versions[0], utc(4, 6))
    assert owes(versions[0], utc(3, 6)) and owes(versions[1], utc(4, 7))


def test_a_one_shot_moved_before_it_fell_due_owes_only_the_new_time() -> None:
    changed = utc(4, 5)
    versions = [Version(once(utc(4, 6)), None, changed), Version(once(utc(4, 7)), changed)]
    assert instants(owed_between(versions, utc(1), utc(9), 10)) == [utc(4, 7)]


def test_a_one_shot_moved_after_it_fell_due_owes_both_times() -> None:
    changed = utc(4, 8)  # 06:00 fell due under the first version
    versions = [Version(once(utc(4, 6)), None, changed), Version(once(utc(4, 7)), changed)]
    # 07:00 is before the change, yet owed: a one-shot loaded late fires at once.
    assert instants(owed_between(versions, utc(1), utc(9), 10)) == [utc(4, 6), utc(4, 7)]


def test_the_window_bounds_are_inclusive_and_the_limit_holds() -> None:
    versions = [Version(daily("06:00"))]
    assert instants(owed_between(versions, utc(2, 6), utc(4, 6), 10)) == [
        utc(2, 6),
        utc(3, 6),
        utc(4, 6),
    ]
    assert instants(owed_between(versions, utc(2, 6), utc(4, 6), 2)) == [utc(2, 6), utc(3, 6)]
    assert owed_between(versions, utc(4, 6), utc(2, 6), 10) == []


def test_owes_compares_at_the_resolution_of_the_key_a_whole_second() -> None:
    version = Version(once(utc(4, 6, 0, 0, 500_000)))
    assert owes(version, utc(4, 6, 0, 0, 900_000))  # the same key: the same occurrence
    assert not owes(version, utc(4, 6, 0, 1))
    assert owes(Version(daily("06:00")), utc(4, 6, 0, 0, 1))
    assert not owes(Version(daily("06:00")), utc(4, 6, 1))


def test_a_version_from_a_later_instant_does_not_owe_what_came_before_it() -> None:
    version = Version(daily("06:00"), valid_from=utc(4, 6, 0, 1))
    assert not owes(version, utc(4, 6)) and owes(version, utc(5, 6))


def test_two_versions_that_owe_the_same_second_list_it_once_under_the_older() -> None:
    first = Version(daily("06:00"), None, utc(4, 12))
    late = Version(once(utc(3, 6)), utc(4, 12))  # a one-shot moved into the past
    found = owed_between([first, late], utc(3), utc(3, 23), 10)
    assert [(o.at, o.schedule) for o in found] == [(utc(3, 6), first.schedule)]


# ------------------------------------------------------------------ properties

TIMES = [f"{h:02d}:{m:02d}" for h in (0, 5, 6, 7, 23) for m in (0, 30)]
ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Kathmandu"]
BASE = datetime(2026, 1, 1, tzinfo=UTC)
recurring = st.builds(daily, st.sampled_from(TIMES), st.sampled_from(ZONES)) | st.builds(
    lambda m, zone: Schedule(kind="cron", timezone=zone, cron=f"{m} */5 * * *"),
    st.integers(0, 59),
    st.sampled_from(ZONES),
)
minutes = st.integers(0, 200 * 24 * 60)


def _versions(schedules: list[Schedule], cuts: list[int]) -> list[Version]:
    """Consecutive versions: schedule i in force from cut i-1 to cut i."""
    bounds: list[datetime | None] = [None]
    bounds += [BASE + timedelta(minutes=m) for m in sorted(cuts)]
    bounds.append(None)
    return [Version(s, bounds[i], bounds[i + 1]) for i, s in enumerate(schedules)]


def _in_force_at(versions: list[Version], at: datetime) -> Version:
    return next(
        v
        for v in versions
        if (v.valid_from is None or v.valid_from <= at) and (v.valid_to is None or at < v.valid_to)
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedules=st.lists(recurring, min_size=1, max_size=4),
    data=st.data(),
    start=minutes,
    span=st.integers(0, 40 * 24 * 60),
)
def test_property_each_instant_is_owed_by_the_schedule_in_force_then_and_only_by_it(
    schedules: list[Schedule], data: st.DataObject, start: int, span: int
) -> None:
    cuts = data.draw(st.lists(minutes, min_size=len(schedules) - 1, max_size=len(schedules) - 1))
    versions = _versions(schedules, cuts)
    lo = BASE + timedelta(minutes=start)
    hi = lo + timedelta(minutes=span)
    found = owed_between(versions, lo, hi, 10_000)
    assert all(a.at < b.at for a, b in pairwise(found))
    assert all(lo <= o.at <= hi for o in found)
    # Each listed occurrence is owed by the version in force at that instant...
    for o in found:
        version = _in_force_at(versions, o.at)
        assert o.schedule == version.schedule and owes(version, o.at)
    # ...and every occurrence a version has while in force (inside the window) is listed.
    expected = sorted(
        at
        for v in versions
        for at in occurrences(v.schedule, lo, hi, 10_000)
        if _in_force_at(versions, at) is v
    )
    assert instants(found) == expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=recurring, cut=minutes, start=minutes, span=st.integers(0, 20 * 24 * 60))
def test_property_an_edit_to_the_same_schedule_changes_nothing_owed(
    schedule: Schedule, cut: int, start: int, span: int
) -> None:
    lo = BASE + timedelta(minutes=start)
    hi = lo + timedelta(minutes=span)
    whole = owed_between([Version(schedule)], lo, hi, 10_000)
    split = owed_between(_versions([schedule, schedule], [cut]), lo, hi, 10_000)
    assert split == whole == [Owed(at, schedule) for at in occurrences(schedule, lo, hi, 10_000)]
