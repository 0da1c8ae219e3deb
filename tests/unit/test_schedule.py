"""Unit tests for service.schedule: pure calendar arithmetic, no I/O, no clock."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo, available_timezones

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.schedule import (
    MAX_OWED_LISTED,
    SKIP_CATCH_UP_LIMIT,
    SKIP_MISSED,
    SKIP_TRUNCATED,
    MissedPolicy,
    Plan,
    Schedule,
    ScheduleError,
    first_occurrence,
    next_occurrence_after,
    occurrences,
    parse_daily_at,
    plan_due,
    validate,
)


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


def daily(zone: str, at: str) -> Schedule:
    return Schedule(kind="daily", timezone=zone, daily_at=parse_daily_at(at))


def cron(zone: str, expr: str) -> Schedule:
    return Schedule(kind="cron", timezone=zone, cron=expr)


def occ_on(schedule: Schedule, local_day: date) -> list[datetime]:
    """Occurrences whose local date (in the schedule's zone) is ``local_day``."""
    tz = ZoneInfo(schedule.timezone)
    around = datetime.combine(local_day, time(12), tzinfo=UTC)
    found = occurrences(schedule, around - timedelta(days=2), around + timedelta(days=2), 100)
    return [o for o in found if o.astimezone(tz).date() == local_day]


def assert_strictly_increasing_utc(found: list[datetime]) -> None:
    assert all(o.tzinfo is UTC for o in found)
    assert all(a < b for a, b in pairwise(found))


# ------------------------------------------------------------------ daily, two years


@pytest.mark.parametrize(
    "zone",
    [
        "Europe/Berlin",
        "America/New_York",
        "Australia/Lord_Howe",  # 30-minute DST shift
        "Asia/Kathmandu",  # +05:45
        "Pacific/Chatham",  # +12:45 / +13:45
    ],
)
def test_daily_0600_two_years_every_local_date_once(zone: str) -> None:
    tz = ZoneInfo(zone)
    first_day, last_day = date(2026, 1, 1), date(2027, 12, 31)
    start = datetime.combine(first_day, time(0), tzinfo=tz)
    end = datetime.combine(last_day, time(23, 59), tzinfo=tz)

    found = occurrences(daily(zone, "06:00"), start, end, 10_000)

    assert_strictly_increasing_utc(found)
    local = [o.astimezone(tz) for o in found]
    assert all(lt.time() == time(6, 0) for lt in local)
    expected_days = [first_day + timedelta(days=i) for i in range((last_day - first_day).days + 1)]
    assert [lt.date() for lt in local] == expected_days  # one per date, none missing
    # The zone really does shift (except Kathmandu): the UTC time of day is not constant.
    if zone != "Asia/Kathmandu":
        assert len({o.time() for o in found}) == 2


# -------------------------------------------------------- DST gap and overlap, daily


@pytest.mark.parametrize(
    ("zone", "at", "local_day", "expected_utc", "expected_local"),
    [
        # Spring forward: 02:00 -> 03:00; 02:30 does not exist -> the transition, 03:00 CEST.
        ("Europe/Berlin", "02:30", date(2026, 3, 29), utc(2026, 3, 29, 1, 0), "03:00+02:00"),
        # Fall back: 03:00 -> 02:00; 02:30 exists twice -> the first one, CEST.
        ("Europe/Berlin", "02:30", date(2026, 10, 25), utc(2026, 10, 25, 0, 30), "02:30+02:00"),
        ("Europe/Berlin", "02:30", date(2027, 3, 28), utc(2027, 3, 28, 1, 0), "03:00+02:00"),
        ("Europe/Berlin", "02:30", date(2027, 10, 31), utc(2027, 10, 31, 0, 30), "02:30+02:00"),
        # New York springs forward at 02:00 -> 03:00; 02:30 -> 03:00 EDT.
        ("America/New_York", "02:30", date(2026, 3, 8), utc(2026, 3, 8, 7, 0), "03:00-04:00"),
        # It falls back at 02:00 -> 01:00: 02:30 is unambiguous EST, 01:30 exists twice.
        ("America/New_York", "02:30", date(2026, 11, 1), utc(2026, 11, 1, 7, 30), "02:30-05:00"),
        ("America/New_York", "01:30", date(2026, 11, 1), utc(2026, 11, 1, 5, 30), "01:30-04:00"),
        # Lord Howe springs forward by 30 minutes, 02:00 -> 02:30: 02:15 -> 02:30 +11:00,
        # 02:30 itself is the first valid wall time and fires normally.
        (
            "Australia/Lord_Howe",
            "02:15",
            date(2026, 10, 4),
            utc(2026, 10, 3, 15, 30),
            "02:30+11:00",
        ),
        (
            "Australia/Lord_Howe",
            "02:30",
            date(2026, 10, 4),
            utc(2026, 10, 3, 15, 30),
            "02:30+11:00",
        ),
        # ... and falls back 02:00 -> 01:30: 01:45 exists twice -> the first, +11:00.
        (
            "Australia/Lord_Howe",
            "01:45",
            date(2026, 4, 5),
            utc(2026, 4, 4, 14, 45),
            "01:45+11:00",
        ),
    ],
)
def test_daily_on_transition_days_fires_exactly_once(
    zone: str, at: str, local_day: date, expected_utc: datetime, expected_local: str
) -> None:
    schedule = daily(zone, at)
    assert occ_on(schedule, local_day) == [expected_utc]
    assert (
        expected_utc.astimezone(ZoneInfo(zone)).isoformat(timespec="minutes")[11:] == expected_local
    )
    # And exactly once on the neighbouring days, at the normal time.
    for neighbour in (local_day - timedelta(days=1), local_day + timedelta(days=1)):
        [occ] = occ_on(schedule, neighbour)
        assert occ.astimezone(ZoneInfo(zone)).strftime("%H:%M") == at


def test_gap_substitute_can_fall_on_the_next_local_date() -> None:
    # Nuuk springs forward at 23:00 -02:00 -> 00:00 -01:00 (01:00Z): Saturday's 23:30 does
    # not exist and fires at the transition, which is already Sunday 00:00 local.
    tz = ZoneInfo("America/Nuuk")
    found = occurrences(daily("America/Nuuk", "23:30"), utc(2026, 3, 27), utc(2026, 3, 31), 10)
    assert [o.astimezone(tz).isoformat(timespec="minutes") for o in found] == [
        "2026-03-26T23:30-02:00",
        "2026-03-27T23:30-02:00",
        "2026-03-29T00:00-01:00",  # Saturday 2026-03-28's occurrence
        "2026-03-29T23:30-01:00",
    ]


def test_gap_substitute_is_the_transition_instant() -> None:
    tz = ZoneInfo("Europe/Berlin")
    [occ] = occ_on(daily("Europe/Berlin", "02:30"), date(2026, 3, 29))
    assert (occ - timedelta(seconds=1)).astimezone(tz).utcoffset() == timedelta(hours=1)
    assert occ.astimezone(tz).utcoffset() == timedelta(hours=2)


def test_next_occurrence_after_inside_overlap_second_pass() -> None:
    # 01:00Z on 2026-10-25 is 02:00 CET, the second pass of Berlin's 02:00-03:00: the 02:30
    # occurrence already fired in the first pass (00:30Z); next is tomorrow's.
    schedule = daily("Europe/Berlin", "02:30")
    assert next_occurrence_after(schedule, utc(2026, 10, 25, 0, 29)) == utc(2026, 10, 25, 0, 30)
    assert next_occurrence_after(schedule, utc(2026, 10, 25, 0, 30)) == utc(2026, 10, 26, 1, 30)
    assert next_occurrence_after(schedule, utc(2026, 10, 25, 1, 0)) == utc(2026, 10, 26, 1, 30)


# ------------------------------------------------------------------------------ cron


def test_cron_weekdays_0600_berlin_across_dst_changes() -> None:
    tz = ZoneInfo("Europe/Berlin")
    schedule = cron("Europe/Berlin", "0 6 * * 1-5")
    for first, last in [
        (date(2026, 3, 23), date(2026, 4, 3)),
        (date(2026, 10, 19), date(2026, 10, 30)),
    ]:
        start = datetime.combine(first, time(0), tzinfo=tz)
        end = datetime.combine(last, time(23, 59), tzinfo=tz)
        found = occurrences(schedule, start, end, 100)
        assert_strictly_increasing_utc(found)
        local = [o.astimezone(tz) for o in found]
        expected = [
            first + timedelta(days=i)
            for i in range((last - first).days + 1)
            if (first + timedelta(days=i)).weekday() < 5
        ]
        assert [lt.date() for lt in local] == expected
        assert all(lt.time() == time(6) for lt in local)
        assert {o.hour for o in found} == {4, 5}  # CEST 04:00Z and CET 05:00Z both occur


def test_cron_0230_obeys_gap_and_overlap_rules() -> None:
    schedule = cron("Europe/Berlin", "30 2 * * *")
    assert occ_on(schedule, date(2026, 3, 29)) == [utc(2026, 3, 29, 1, 0)]  # 03:00 CEST
    assert occ_on(schedule, date(2026, 10, 25)) == [utc(2026, 10, 25, 0, 30)]  # first 02:30
    ny = cron("America/New_York", "30 2 * * *")
    assert occ_on(ny, date(2026, 3, 8)) == [utc(2026, 3, 8, 7, 0)]  # 03:00 EDT
    assert occ_on(ny, date(2026, 11, 1)) == [utc(2026, 11, 1, 7, 30)]  # 02:30 EST


def test_cron_wall_times_collapsing_in_a_gap_fire_once() -> None:
    # 02:00, 02:15, 02:30, 02:45 do not exist and 03:00 is the transition instant itself:
    # all five map to 01:00Z and must be deduplicated to a single occurrence.
    schedule = cron("Europe/Berlin", "*/15 2-3 * * *")
    found = occ_on(schedule, date(2026, 3, 29))
    assert found == [
        utc(2026, 3, 29, 1, 0),
        utc(2026, 3, 29, 1, 15),
        utc(2026, 3, 29, 1, 30),
        utc(2026, 3, 29, 1, 45),
    ]


def test_cron_minutely_across_overlap_is_strictly_increasing() -> None:
    schedule = cron("Europe/Berlin", "* * * * *")
    found = occurrences(schedule, utc(2026, 10, 24, 23, 0), utc(2026, 10, 25, 3, 0), 1_000)
    assert_strictly_increasing_utc(found)
    # Wall times 02:00-02:59 fire only in the first pass (00:00Z-00:59Z): nothing during
    # the repeated hour 01:00Z-01:59Z, then minutely again from 03:00 CET = 02:00Z.
    assert utc(2026, 10, 25, 0, 59) in found
    assert not [o for o in found if utc(2026, 10, 25, 1, 0) <= o < utc(2026, 10, 25, 2, 0)]
    assert utc(2026, 10, 25, 2, 0) in found
    assert len(found) == 4 * 60 + 1 - 60


def test_cron_next_occurrence_after_is_strict() -> None:
    schedule = cron("UTC", "0 6 * * *")
    assert next_occurrence_after(schedule, utc(2026, 1, 1, 6, 0)) == utc(2026, 1, 2, 6, 0)
    assert first_occurrence(schedule, utc(2026, 1, 1, 6, 0)) == utc(2026, 1, 1, 6, 0)
    assert first_occurrence(schedule, utc(2026, 1, 1, 6, 0, 0, 1)) == utc(2026, 1, 2, 6, 0)


# ------------------------------------------------------------------------------ once


def test_once_returns_due_at_in_utc() -> None:
    due = datetime(2026, 5, 1, 9, 30, tzinfo=ZoneInfo("Europe/Berlin"))
    schedule = Schedule(kind="once", due_at=due)
    expected = utc(2026, 5, 1, 7, 30)
    # first_occurrence returns due_at even when it is in the past: the caller decides.
    assert first_occurrence(schedule, utc(2030, 1, 1)) == expected
    assert first_occurrence(schedule, utc(2020, 1, 1)) == expected
    assert first_occurrence(schedule, utc(2020, 1, 1)).tzinfo is UTC  # type: ignore[union-attr]
    assert next_occurrence_after(schedule, utc(2026, 5, 1, 7, 29)) == expected
    assert next_occurrence_after(schedule, expected) is None
    assert occurrences(schedule, expected, expected, 5) == [expected]
    assert occurrences(schedule, utc(2026, 1, 1), utc(2026, 5, 1), 5) == []


def test_occurrences_bounds_and_limit() -> None:
    schedule = daily("UTC", "06:00")
    assert occurrences(schedule, utc(2026, 1, 1, 6), utc(2026, 1, 3, 6), 10) == [
        utc(2026, 1, 1, 6),
        utc(2026, 1, 2, 6),
        utc(2026, 1, 3, 6),
    ]
    assert occurrences(schedule, utc(2026, 1, 1, 6), utc(2026, 1, 3, 6), 2) == [
        utc(2026, 1, 1, 6),
        utc(2026, 1, 2, 6),
    ]
    assert occurrences(schedule, utc(2026, 1, 1, 6), utc(2026, 1, 3, 6), 0) == []
    assert occurrences(schedule, utc(2026, 1, 3), utc(2026, 1, 1), 10) == []


# -------------------------------------------------------------------------- plan_due

BERLIN_0600 = daily("Europe/Berlin", "06:00")
# Publisher down from just before Monday 2026-03-02 06:00 until Thursday 05:00 (local).
STORED = utc(2026, 3, 2, 5, 0)  # Monday 06:00 CET
NOW = utc(2026, 3, 5, 4, 0)  # Thursday 05:00 CET
MISSED = [utc(2026, 3, 2, 5), utc(2026, 3, 3, 5), utc(2026, 3, 4, 5)]
NEXT = utc(2026, 3, 5, 5, 0)  # Thursday 06:00 CET
GRACE = timedelta(minutes=15)


def plan(policy: MissedPolicy, catch_up_limit: int = 10, now: datetime = NOW) -> Plan:
    return plan_due(BERLIN_0600, STORED, now, policy, GRACE, catch_up_limit)


def test_plan_due_catch_up_sends_every_missed_occurrence() -> None:
    assert plan("catch_up") == Plan(send=MISSED, skipped=[], next_due_at=NEXT)


def test_plan_due_catch_up_is_bounded_by_limit_newest_first() -> None:
    assert plan("catch_up", catch_up_limit=2) == Plan(
        send=MISSED[1:], skipped=[(MISSED[0], SKIP_CATCH_UP_LIMIT)], next_due_at=NEXT
    )
    assert plan("catch_up", catch_up_limit=0) == Plan(
        send=[], skipped=[(o, SKIP_CATCH_UP_LIMIT) for o in MISSED], next_due_at=NEXT
    )


def test_plan_due_latest_sends_one() -> None:
    assert plan("latest") == Plan(
        send=[MISSED[-1]], skipped=[(o, SKIP_MISSED) for o in MISSED[:-1]], next_due_at=NEXT
    )


def test_plan_due_skip_sends_none_and_records_every_missed() -> None:
    assert plan("skip") == Plan(
        send=[], skipped=[(o, SKIP_MISSED) for o in MISSED], next_due_at=NEXT
    )


def test_plan_due_skip_sends_the_on_time_occurrence() -> None:
    now = NEXT + GRACE  # Thursday's 06:00 is exactly at the edge of the grace period
    result = plan("skip", now=now)
    assert result == Plan(
        send=[NEXT],
        skipped=[(o, SKIP_MISSED) for o in MISSED],
        next_due_at=utc(2026, 3, 6, 5, 0),
    )
    late = plan("skip", now=now + timedelta(microseconds=1))
    assert late.send == [] and late.skipped[-1] == (NEXT, SKIP_MISSED)


def test_plan_due_on_time_normal_tick() -> None:
    now = STORED + timedelta(seconds=3)
    for policy in ("catch_up", "latest", "skip"):
        assert plan_due(BERLIN_0600, STORED, now, policy, GRACE, 5) == Plan(
            send=[STORED], skipped=[], next_due_at=utc(2026, 3, 3, 5, 0)
        )


def test_plan_due_now_in_second_pass_of_overlap() -> None:
    # now = 02:30 CET, the repeated hour: 02:40 already happened in the first pass
    # (00:40Z) although 02:40 is later than 02:30 on the wall clock. It must be owed.
    schedule = cron("Europe/Berlin", "*/20 2 * * *")
    stored = utc(2026, 10, 25, 0, 0)  # 02:00 CEST
    now = utc(2026, 10, 25, 1, 30)  # 02:30 CET
    assert plan_due(schedule, stored, now, "catch_up", GRACE, 10) == Plan(
        send=[utc(2026, 10, 25, 0, 0), utc(2026, 10, 25, 0, 20), utc(2026, 10, 25, 0, 40)],
        skipped=[],
        next_due_at=utc(2026, 10, 26, 1, 0),  # Monday 02:00 CET
    )


def test_plan_due_called_early_changes_nothing() -> None:
    early = STORED - timedelta(hours=1)
    assert plan_due(BERLIN_0600, STORED, early, "catch_up", GRACE, 5) == Plan(
        send=[], skipped=[], next_due_at=STORED
    )


def test_plan_due_once_finishes() -> None:
    due = utc(2026, 3, 2, 5)
    schedule = Schedule(kind="once", due_at=due)
    assert plan_due(schedule, due, due + timedelta(days=3), "catch_up", GRACE, 5) == Plan(
        send=[due], skipped=[], next_due_at=None
    )
    assert plan_due(schedule, due, due + timedelta(days=3), "skip", GRACE, 5) == Plan(
        send=[], skipped=[(due, SKIP_MISSED)], next_due_at=None
    )


def test_plan_due_long_outage_is_bounded() -> None:
    # Minutely cron, publisher down for 30 days: 43,200 owed occurrences.
    schedule = cron("Europe/Berlin", "* * * * *")
    stored = utc(2026, 3, 1)
    now = stored + timedelta(days=30)
    result = plan_due(schedule, stored, now, "catch_up", GRACE, 5)
    newest = [now - timedelta(minutes=i) for i in range(MAX_OWED_LISTED)][::-1]
    assert result.send == newest[-5:]
    assert result.skipped[0] == (stored, SKIP_TRUNCATED)
    assert result.skipped[1:] == [(o, SKIP_CATCH_UP_LIMIT) for o in newest[:-5]]
    assert result.next_due_at == now + timedelta(minutes=1)

    skip = plan_due(schedule, stored, now, "skip", GRACE, 5)
    assert skip.send == newest[-16:]  # the 16 within the 15-minute grace (both ends inclusive)
    assert skip.skipped[0] == (stored, SKIP_TRUNCATED)
    assert len(skip.skipped) == 1 + MAX_OWED_LISTED - 16


def test_plan_due_exactly_max_listed_is_not_truncated() -> None:
    schedule = cron("UTC", "* * * * *")
    stored = utc(2026, 3, 1)
    now = stored + timedelta(minutes=MAX_OWED_LISTED - 1)
    result = plan_due(schedule, stored, now, "latest", GRACE, 5)
    assert result.send == [now]
    assert len(result.skipped) == MAX_OWED_LISTED - 1
    assert all(reason == SKIP_MISSED for _, reason in result.skipped)
    truncated = plan_due(schedule, stored, now + timedelta(minutes=1), "latest", GRACE, 5)
    assert truncated.skipped[0] == (stored, SKIP_TRUNCATED)


# -------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (
            Schedule(kind="daily", timezone="Mars/Base", daily_at=time(6)),
            "unknown time zone 'Mars/Base'",
        ),
        (
            Schedule(kind="daily", timezone="America", daily_at=time(6)),
            "unknown time zone 'America'",
        ),
        (Schedule(kind="daily", timezone="", daily_at=time(6)), "unknown time zone ''"),
        (Schedule(kind="daily", timezone="../etc", daily_at=time(6)), "unknown time zone '../etc'"),
        (Schedule(kind="weekly", daily_at=time(6)), "unknown schedule kind 'weekly'"),  # type: ignore[arg-type]
        (Schedule(kind="once"), "due_at is required for a 'once' schedule"),
        (Schedule(kind="daily"), "daily_at is required for a 'daily' schedule"),
        (Schedule(kind="cron"), "cron is required for a 'cron' schedule"),
        (
            Schedule(kind="once", due_at=datetime(2026, 1, 1)),
            "due_at must be timezone-aware (got a naive datetime)",
        ),
        (
            Schedule(kind="daily", daily_at=time(6), cron="0 6 * * *"),
            "cron must not be set for a 'daily' schedule",
        ),
        (Schedule(kind="daily", daily_at=time(6, 0, 30)), "daily_at must be HH:MM (no seconds)"),
        (Schedule(kind="daily", daily_at=time(6, tzinfo=UTC)), "without tzinfo"),
        (Schedule(kind="cron", cron="0 6 * *"), "expected 5 fields"),
        (Schedule(kind="cron", cron="0 0 6 * * *"), "expected 5 fields"),
        (Schedule(kind="cron", cron="@daily"), "expected 5 fields"),
        (Schedule(kind="cron", cron="61 6 * * *"), "bad cron expression '61 6 * * *'"),
        (Schedule(kind="cron", cron="0 6 * * mon-xyz"), "bad cron expression"),
        (Schedule(kind="cron", cron="0 0 30 2 *"), "it never fires"),
    ],
)
def test_validate_errors_name_the_problem(schedule: Schedule, message: str) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        validate(schedule)
    assert message in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


@pytest.mark.parametrize(
    "schedule",
    [
        Schedule(kind="once", due_at=utc(2026, 1, 1)),
        Schedule(kind="daily", timezone="Asia/Kathmandu", daily_at=time(23, 59)),
        Schedule(kind="cron", timezone="America/New_York", cron="*/5 9-17 * * mon-fri"),
        Schedule(kind="cron", cron="0 0 29 2 *"),  # fires only in leap years
    ],
)
def test_validate_accepts_good_schedules(schedule: Schedule) -> None:
    validate(schedule)


def test_host_local_zone_is_rejected() -> None:
    with pytest.raises(ScheduleError, match="unknown time zone 'localtime'"):
        validate(Schedule(kind="daily", timezone="localtime", daily_at=time(6)))


def test_functions_validate_and_reject_naive_arguments() -> None:
    bad = Schedule(kind="daily", timezone="Mars/Base", daily_at=time(6))
    with pytest.raises(ScheduleError, match="unknown time zone 'Mars/Base'"):
        next_occurrence_after(bad, utc(2026, 1, 1))
    with pytest.raises(ScheduleError, match="now must be timezone-aware"):
        plan_due(BERLIN_0600, STORED, datetime(2026, 3, 5), "skip", GRACE, 5)
    with pytest.raises(ScheduleError, match="start must be timezone-aware"):
        occurrences(BERLIN_0600, datetime(2026, 3, 5), NOW, 5)
    with pytest.raises(ScheduleError, match="unknown missed policy 'sometimes'"):
        plan_due(BERLIN_0600, STORED, NOW, "sometimes", GRACE, 5)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="catch_up_limit must be >= 0"):
        plan_due(BERLIN_0600, STORED, NOW, "catch_up", GRACE, -1)
    with pytest.raises(ScheduleError, match="misfire_grace"):
        plan_due(BERLIN_0600, STORED, NOW, "skip", -GRACE, 5)


@pytest.mark.parametrize(
    ("text", "expected"), [("00:00", time(0)), ("06:05", time(6, 5)), ("23:59", time(23, 59))]
)
def test_parse_daily_at_accepts_hh_mm(text: str, expected: time) -> None:
    assert parse_daily_at(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "6:00",
        "24:00",
        "12:60",
        "06:00:00",
        " 06:00",
        "0600",
        "",
        "ab:cd",
        "\u0660\u0666:\u0660\u0660",
    ],
)
def test_parse_daily_at_rejects_others(text: str) -> None:
    with pytest.raises(ScheduleError, match="daily_at must be HH:MM"):
        parse_daily_at(text)


# ----------------------------------------------------------------------- properties

# Sorted so hypothesis draws map to the same zones on every run. "localtime" (listed on
# hosts whose zoneinfo tree links it to /etc/localtime) is host-dependent and rejected.
ZONES = sorted(available_timezones() - {"localtime"})


def occurrence_matches(occ: datetime, tz: ZoneInfo, at: time) -> bool:
    """occ is at wall time ``at`` (first pass if repeated) or is the transition instant
    ending a gap that swallowed ``at`` -- checked independently of the implementation."""
    local = occ.astimezone(tz)
    if local.time() == at:
        return local.fold == 0
    before = (occ - timedelta(seconds=1)).astimezone(tz).utcoffset()
    after = local.utcoffset()
    assert before is not None and after is not None
    if before >= after:  # not a forward jump: no gap ends here
        return False
    wall_before, wall_after = (
        (occ + before).replace(tzinfo=None),
        (occ + after).replace(tzinfo=None),
    )
    return any(
        wall_before <= datetime.combine(day, at) < wall_after
        for day in {wall_before.date(), wall_after.date()}
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    zone=st.sampled_from(ZONES),
    hour=st.integers(0, 23),
    minute=st.integers(0, 59),
    kind=st.sampled_from(["daily", "cron"]),
    start=st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2037, 12, 31)),
    span=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=120)),
)
def test_property_occurrences_are_increasing_and_at_the_requested_wall_time(
    zone: str, hour: int, minute: int, kind: str, start: datetime, span: timedelta
) -> None:
    tz = ZoneInfo(zone)
    at = time(hour, minute)
    schedule = (
        daily(zone, at.strftime("%H:%M"))
        if kind == "daily"
        else cron(zone, f"{minute} {hour} * * *")
    )
    lo = start.replace(tzinfo=UTC)
    hi = lo + span
    found = occurrences(schedule, lo, hi, 1_000)

    assert_strictly_increasing_utc(found)
    assert len(set(found)) == len(found)
    assert all(lo <= o <= hi for o in found)
    for o in found:
        assert occurrence_matches(o, tz, at), (o, o.astimezone(tz))
    # Walking one at a time gives the same sequence as the range query (spot check).
    if found:
        assert first_occurrence(schedule, lo) == found[0]
        for a, b in pairwise(found[:10]):
            assert next_occurrence_after(schedule, a) == b
    # Completeness, per local date: an existing wall time must fire at its first instant;
    # a wall time swallowed by a gap must fire somewhere between its two readings (the
    # offsets before and after the transition), i.e. at the transition.
    found_set = set(found)
    day, last_day = lo.astimezone(tz).date(), hi.astimezone(tz).date()
    while day <= last_day:
        wall = datetime.combine(day, at)
        first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
        if first.astimezone(tz).replace(tzinfo=None) == wall:
            if lo <= first <= hi:
                assert first in found_set, (day, first)
        else:
            a, b = min(first, second), max(first, second)
            if lo <= a and b <= hi:
                assert any(a <= o <= b for o in found), (day, a, b)
        day += timedelta(days=1)


@settings(max_examples=100, deadline=None)
@given(
    zone=st.sampled_from(ZONES),
    expr=st.sampled_from(["30 2 * * *", "*/20 1-3 * * *", "0 6 * * 1-5", "45 23 * * 0"]),
    policy=st.sampled_from(["catch_up", "latest", "skip"]),
    stored=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2035, 12, 31)),
    down=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=10)),
    grace_minutes=st.integers(0, 600),
    catch_up_limit=st.integers(0, 20),
)
def test_property_plan_due_never_drops_an_owed_occurrence(
    zone: str,
    expr: str,
    policy: MissedPolicy,
    stored: datetime,
    down: timedelta,
    grace_minutes: int,
    catch_up_limit: int,
) -> None:
    schedule = cron(zone, expr)
    stored_at = first_occurrence(schedule, stored.replace(tzinfo=UTC))
    assert stored_at is not None
    now = stored_at + down
    grace = timedelta(minutes=grace_minutes)
    result = plan_due(schedule, stored_at, now, policy, grace, catch_up_limit)

    owed = occurrences(schedule, stored_at, now, 10_000)
    assert owed and owed[0] == stored_at
    listed = sorted(result.send + [o for o, _ in result.skipped])
    assert listed == owed  # every owed occurrence exactly once, send or skipped
    assert result.send == sorted(result.send)
    assert result.next_due_at == next_occurrence_after(schedule, now)
    if policy == "catch_up":
        assert result.send == owed[len(owed) - min(catch_up_limit, len(owed)) :]
    elif policy == "latest":
        assert result.send == owed[-1:]
    else:
        assert result.send == [o for o in owed if now - o <= grace]
