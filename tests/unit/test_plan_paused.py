"""Planning admission after a pause: occurrences due inside a pause window are skipped
('paused') whatever the missed-fire policy; those outside follow it."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

import pytest

from publisher.plan import SKIP_PAUSED, plan_batch
from service.settings import Settings

NOW = datetime(2026, 3, 2, 7, 15, tzinfo=UTC)


def _row(policy: str, next_due_at: datetime) -> dict[str, object]:
    return {
        "id": "clinic-42",
        "channel": "email",
        "provider": "default",
        "urgent": False,
        "schedule_kind": "cron",
        "due_at": None,
        "daily_at": None,
        "cron": "*/5 * * * *",
        "timezone": "UTC",
        "missed_policy": policy,
        "next_due_at": next_due_at,
    }


@pytest.mark.parametrize("policy", ["catch_up", "latest", "skip"])
def test_occurrences_inside_a_pause_window_are_skipped_paused_under_every_policy(
    policy: str,
) -> None:
    settings = Settings(publish_lookahead_seconds=0, misfire_grace_seconds=3600)
    window = (datetime(2026, 3, 2, 6, 52, tzinfo=UTC), datetime(2026, 3, 2, 7, 3, tzinfo=UTC))
    first = datetime(2026, 3, 2, 6, 50, tzinfo=UTC)
    new, advances = plan_batch([_row(policy, first)], NOW, settings, [window])  # type: ignore[list-item]
    by_time = {d.occurrence_at.time(): d.skip_reason for d in new}
    assert by_time[time(6, 55)] == SKIP_PAUSED
    assert by_time[time(7, 0)] == SKIP_PAUSED
    assert by_time.get(time(6, 50)) != SKIP_PAUSED  # before the pause: the policy decides
    assert by_time[time(7, 15)] is None  # after the resume: sent
    assert advances == [("clinic-42", NOW + timedelta(minutes=5))]


def test_without_pause_windows_nothing_is_skipped_paused() -> None:
    settings = Settings(publish_lookahead_seconds=0)
    first = datetime(2026, 3, 2, 7, 5, tzinfo=UTC)
    new, _ = plan_batch([_row("catch_up", first)], NOW, settings)  # type: ignore[list-item]
    assert [d.skip_reason for d in new] == [None, None, None]
