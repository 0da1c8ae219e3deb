"""Time options (--since, --until, --from, --to, --scheduled-at): ISO 8601 with an offset."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from service import entry, errors


def test_an_offset_time_parses_and_none_stays_none() -> None:
    assert entry.option_time("2026-12-01T06:00:00+00:00", "--since") == datetime(
        2026, 12, 1, 6, tzinfo=UTC
    )
    assert entry.option_time(None, "--since") is None


@pytest.mark.parametrize(
    ("value", "says"), [("yesterday", "not an ISO 8601 time"), ("2026-12-01T06:00", "UTC offset")]
)
def test_a_bad_time_names_the_option(value: str, says: str) -> None:
    with pytest.raises(errors.ConfigError, match=f"--until: .*{says}"):
        entry.option_time(value, "--until")
