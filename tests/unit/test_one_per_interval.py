"""A repeating log line: the first of its kind per interval, with the count held back."""

from __future__ import annotations

from service.logs import OnePerInterval


def test_first_line_per_kind_per_interval_then_the_count_held_back() -> None:
    now = [100.0]
    lines = OnePerInterval(60.0, monotonic=lambda: now[0])
    assert lines.admit("destination disabled") == 0
    assert [lines.admit("destination disabled") for _ in range(3)] == [None, None, None]
    assert lines.admit("rate budget exhausted") == 0  # another kind has its own interval
    now[0] += 59.9
    assert lines.admit("destination disabled") is None
    now[0] += 0.1
    assert lines.admit("destination disabled") == 4  # held back since the last one
    assert lines.admit("destination disabled") is None
    now[0] += 60.0
    assert lines.admit("destination disabled") == 1
    assert lines.admit("rate budget exhausted") == 0
