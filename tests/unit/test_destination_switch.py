"""The pure parts of a destination switch: the count of what resumed reminders owe (the
publisher's rule), and the checks the CLI and the console share."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from typing import Any

import pytest

from service import destination_switch as ds
from service import netpolicy

NOW = datetime(2030, 1, 10, 8, 0, tzinfo=UTC)
MISSED = ds.MissedFire(grace_seconds=300.0, catch_up_limit=24)


def daily(policy: str, *, days_back: int = 3, **extra: Any) -> dict[str, Any]:
    """A daily 06:00 UTC reminder paused ``days_back`` days ago: it owes that many."""
    return {
        "schedule_kind": "daily",
        "timezone": "UTC",
        "due_at": None,
        "daily_at": time(6, 0),
        "cron": None,
        "missed_policy": policy,
        "next_due_at": datetime(2030, 1, 10 - days_back + 1, 6, 0, tzinfo=UTC),
        "stale_after_seconds": None,
        "send_stale": False,
    } | extra


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("skip", ds.Owed(send=0, stale=0, skipped=3)),  # every one is past the grace
        ("latest", ds.Owed(send=1, stale=0, skipped=2)),
        ("catch_up", ds.Owed(send=3, stale=0, skipped=0)),
    ],
)
def test_owed_occurrences_follow_the_missed_fire_policy(policy: str, expected: ds.Owed) -> None:
    assert ds.owed_occurrences([daily(policy)], NOW, MISSED) == expected


def test_the_catch_up_limit_and_stale_after_are_counted_apart() -> None:
    # Owed: 06:00 on the 8th (50 h ago), 9th (26 h), 10th (2 h); stale after 30 h.
    row = daily("catch_up", stale_after_seconds=30 * 3600.0)
    assert ds.owed_occurrences([row], NOW, MISSED) == ds.Owed(send=2, stale=1, skipped=0)
    marked = row | {"send_stale": True}  # sent marked stale, not skipped
    assert ds.owed_occurrences([marked], NOW, MISSED) == ds.Owed(send=3, stale=0, skipped=0)
    limited = ds.MissedFire(grace_seconds=300.0, catch_up_limit=1)
    assert ds.owed_occurrences([row], NOW, limited) == ds.Owed(send=1, stale=0, skipped=2)


def test_an_occurrence_inside_an_admission_pause_is_skipped_whatever_the_policy() -> None:
    window = (datetime(2030, 1, 9, 0, 0, tzinfo=UTC), datetime(2030, 1, 9, 12, 0, tzinfo=UTC))
    owed = ds.owed_occurrences([daily("catch_up")], NOW, MISSED, [window])
    assert owed == ds.Owed(send=2, stale=0, skipped=1)


def test_a_reminder_with_nothing_left_or_a_broken_schedule_owes_nothing() -> None:
    finished = daily("catch_up", next_due_at=None)
    broken = daily("catch_up", timezone="Not/AZone")
    assert ds.owed_occurrences([finished, broken], NOW, MISSED) == ds.Owed()


def test_an_on_time_occurrence_is_sent_under_skip() -> None:
    row = daily("skip", next_due_at=NOW - timedelta(minutes=2), daily_at=time(7, 58))
    assert ds.owed_occurrences([row], NOW, MISSED) == ds.Owed(send=1, stale=0, skipped=0)


def test_the_switch_checks_refuse_with_one_clear_line() -> None:
    loopback = netpolicy.parse_networks("127.0.0.0/8")
    assert ds.target("HTTP://127.0.0.1:80/hooks/r", loopback) == "http://127.0.0.1/hooks/r"
    with pytest.raises(ds.SwitchRefused, match=r"^URL refused: "):
        ds.target("someone@example.com", loopback)
    assert ds.reason_of(None, apply=False) == ""  # a dry run needs no reason
    assert ds.reason_of("  back  ", apply=True) == "back"
    with pytest.raises(ds.SwitchRefused, match="say why"):
        ds.reason_of("   ", apply=True)
    with pytest.raises(ds.SwitchRefused, match="longer than 200"):
        ds.reason_of("x" * 201, apply=False)
    with pytest.raises(ds.SwitchRefused, match="operator"):
        ds.reason_of("back", apply=True, operator="")


def test_an_enabling_reports_its_counts_and_whether_it_enabled() -> None:
    done = ds.Enabling("http://x/", applied=False, changed=True, held_send=2)
    assert done.as_dict()["enabled"] is False and done.effect()["held_send"] == 2
    assert set(done.effect()) == {
        "reminders_resumed", "reminders_cancelled", "held_send", "held_stale",
        "held_cancelled", "occurrences_send", "occurrences_stale", "occurrences_skipped",
    }  # fmt: skip
