"""`relay reminders show` lists a reminder's next occurrences, whatever the calendar."""

from __future__ import annotations

import asyncpg

from service.settings import Settings
from tests.support import relay as rs


async def test_reminders_show_lists_occurrences_from_29_february(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """The next occurrence on a leap day used to crash `show` (year + 2 has no 29 Feb)."""
    await rs.load(pool, [rs.line("leap", "http://127.0.0.1:9/hooks/a", daily_at="09:00")])
    await pool.execute(
        "UPDATE reminders SET next_due_at = '2028-02-29T09:00:00+00:00' WHERE id = 'leap'"
    )
    daily = await rs.relay(settings, "reminders", "show", "leap", "--next", "3")
    assert daily.code == 0, daily.stderr
    assert "2028-02-29 09:00 UTC (UTC)" in daily.stdout
    assert "2028-03-02 09:00 UTC (UTC)" in daily.stdout


async def test_reminders_show_at_the_end_of_the_calendar_lists_what_there_is(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    await rs.load(pool, [rs.line("late", "http://127.0.0.1:9/hooks/a", daily_at="09:00")])
    await pool.execute(
        "UPDATE reminders SET next_due_at = '9999-12-30T09:00:00+00:00' WHERE id = 'late'"
    )
    shown = await rs.relay(settings, "reminders", "show", "late")
    assert shown.code == 0, shown.stderr
    assert "9999-12-31 09:00 UTC (UTC)" in shown.stdout
