"""Bad input gets a clear error and loses nothing: settings, arguments, reminder files."""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg
import pytest

from service.settings import Settings
from tests.support import relay as rs


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PREFETCH", "-1", "RELAY_PREFETCH: Input should be greater than or equal to 1"),
        ("LEASE_SECONDS", "soon", "RELAY_LEASE_SECONDS: Input should be a valid number"),
        ("AMQP_NAMESPACE", "Bad Name", "RELAY_AMQP_NAMESPACE: String should match pattern"),
        ("DELAY_TIERS_SECONDS", "5,-1", "RELAY_DELAY_TIERS_SECONDS"),
        ("DATABASE_SSL", "maybe", "RELAY_DATABASE_SSL: must be one of"),
        ("MAX_ATTEMPTS_PER_CHANNEL", "sms:4", "RELAY_MAX_ATTEMPTS_PER_CHANNEL"),
    ],
)
async def test_bad_setting_exits_2_with_one_line_naming_it(
    settings: Settings, variable: str, value: str, expected: str
) -> None:
    result = await rs.relay(settings, "status", **{variable: value})
    assert result.code == 2
    assert result.stderr.startswith("relay: configuration error: "), result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


async def test_bad_reminder_lines_are_named_and_nothing_is_loaded(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    good = rs.line("ok-1", "http://127.0.0.1:9/hooks/a")
    lines = [
        good,
        "{not json",
        json.dumps(
            {
                "id": "x",
                "channel": "webhook",
                "destination": "http://127.0.0.1:9/",
                "payload": {},
                "daily_at": "25:00",
                "timezone": "Europe/Berlin",
            }
        ),
        json.dumps(
            {
                "id": "y",
                "channel": "webhook",
                "destination": "http://127.0.0.1:9/",
                "payload": {},
                "daily_at": "06:00",
                "timezone": "Mars/Olympus",
            }
        ),
        json.dumps(
            {
                "id": "z",
                "channel": "fax",
                "destination": "x",
                "payload": {},
                "due_at": "2026-01-01T00:00:00+00:00",
            }
        ),
        json.dumps(
            {
                "id": "w",
                "channel": "webhook",
                "destination": "http://127.0.0.1:9/",
                "payload": {},
                "due_at": "2026-01-01T00:00:00",
            }
        ),
        good,
    ]
    result = await rs.relay(settings, "reminders", "load", "-", stdin="\n".join(lines))
    assert result.code == 2, result.stderr
    err = result.stderr
    assert "line 2: not valid JSON" in err
    assert "line 3:" in err and "daily_at" in err
    assert "line 4:" in err and "Mars/Olympus" in err
    assert "line 5: channel" in err
    assert "line 6: due_at" in err
    assert "line 7: id 'ok-1' appears twice" in err
    assert "nothing was loaded" in err
    assert await pool.fetchval("SELECT count(*) FROM reminders") == 0


async def test_private_destination_is_refused_at_load_without_an_allowlist(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    lines = [rs.line("a", "http://10.1.2.3/hooks"), rs.line("b", "http://localhost:9/hooks")]
    result = await rs.relay(
        settings, "reminders", "load", "-", stdin="\n".join(lines), ALLOW_NETWORKS=""
    )
    assert result.code == 2
    assert "line 1: destination refused (ssrf: private address)" in result.stderr
    assert "line 2: destination refused (ssrf: loopback address)" in result.stderr
    assert await pool.fetchval("SELECT count(*) FROM reminders") == 0


async def test_good_file_loads_and_a_reload_keeps_the_next_occurrence(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    lines = [
        rs.line(f"d{i}", "http://127.0.0.1:9/hooks/a", daily_at="06:00", timezone="Europe/Berlin")
        for i in range(3)
    ]
    first = await rs.relay(settings, "reminders", "load", "-", stdin="\n".join(lines))
    assert first.code == 0 and "loaded 3 reminders" in first.stdout
    await pool.execute("UPDATE reminders SET next_due_at = next_due_at + interval '1 day'")
    before = await pool.fetch("SELECT id, next_due_at FROM reminders ORDER BY id")
    again = await rs.relay(settings, "reminders", "load", "-", stdin="\n".join(lines))
    assert again.code == 0
    assert await pool.fetch("SELECT id, next_due_at FROM reminders ORDER BY id") == before


async def test_bad_line_after_chunks_already_written_rolls_the_whole_file_back(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # More than two write chunks of good lines, then one bad line: still nothing loaded.
    path = tmp_path / "big.jsonl"
    good = [rs.line(f"r{i}", "http://127.0.0.1:9/hooks/a") for i in range(12001)]
    path.write_text("\n".join([*good, '{"id": "late"}']) + "\n")
    result = await rs.relay(settings, "reminders", "load", str(path))
    assert result.code == 2
    assert "line 12002: channel: Field required" in result.stderr
    assert "nothing was loaded" in result.stderr
    assert await pool.fetchval("SELECT count(*) FROM reminders") == 0


async def test_missing_reminders_file_is_a_clear_error(settings: Settings) -> None:
    result = await rs.relay(settings, "reminders", "load", "/nonexistent/reminders.jsonl")
    assert result.code == 2
    assert "/nonexistent/reminders.jsonl: No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr
