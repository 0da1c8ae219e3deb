"""A repeating log line: the first of its kind per interval, with the count held back."""

from __future__ import annotations

import logging

import pytest

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


def test_log_writes_the_admitted_line_at_info_and_the_rest_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "test_one_per_interval"
    caplog.set_level(logging.DEBUG, logger=name)
    lines = OnePerInterval(60.0, monotonic=lambda: 0.0)
    for n in range(3):
        lines.log(logging.getLogger(name), "held", "deferred", {"event": "deferred", "n": n})
    assert [(r.levelno, r.n, r.held_back) for r in caplog.records] == [  # type: ignore[attr-defined]
        (logging.INFO, 0, 0),
        (logging.DEBUG, 1, 0),
        (logging.DEBUG, 2, 0),
    ]
