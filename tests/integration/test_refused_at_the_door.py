"""Bad reminders are refused when they are loaded, not dead-lettered when they are sent:
each row of issue 14 runs `relay reminders load` in a subprocess and finds exit 2, one
line on stderr naming the line and the reason, and the reminders table unchanged (its row
count and a checksum of its rows)."""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg
import pytest

from service import errors
from service.settings import Settings
from tests.support import relay as rs

pytestmark = pytest.mark.timeout(90)


async def _table(pool: asyncpg.Pool) -> tuple[int, str]:
    """Row count and a checksum of every row of the reminders table."""
    row = await pool.fetchrow(
        "SELECT count(*) AS n, md5(coalesce(string_agg(r::text, '|' ORDER BY r.id), ''))"
        " AS sum FROM reminders r"
    )
    assert row is not None
    return int(row["n"]), str(row["sum"])


@pytest.fixture
async def loaded(pool: asyncpg.Pool) -> tuple[int, str]:
    """One reminder already loaded, so "unchanged" means more than "still empty"."""
    await rs.load(pool, [rs.line("kept-1", "http://127.0.0.1:9/hooks/a", daily_at="06:00")])
    return await _table(pool)


def _reminder(**fields: object) -> dict[str, object]:
    data: dict[str, object] = {
        "id": "r-1",
        "channel": "webhook",
        "destination": "http://127.0.0.1:9/hooks/a",
        "payload": {"text": "hello"},
        "due_at": "2030-01-01T09:00:00+00:00",
    }
    data.update(fields)
    return data


def _nested(depth: int) -> dict[str, object]:
    payload: dict[str, object] = {}
    for _ in range(depth):
        payload = {"a": payload}
    return payload


def _deep_json(depth: int) -> str:
    return '{"a":' * depth + "{}" + "}" * depth


ROWS = {
    "10 MB webhook payload": (
        _reminder(payload={"blob": "x" * 10_000_000}),
        "line 2: longer than 4,194,304 bytes",
    ),
    "300 KiB webhook payload": (
        _reminder(payload={"blob": "x" * 300_000}),
        "line 2: payload: too large (300,011 bytes as JSON; the limit is 262,144) for a webhook",
    ),
    "e-mail destination that is not an address": (
        _reminder(channel="email", destination="not-an-email-address",
                  payload={"subject": "s", "text": "t"}),
        "line 2: destination refused (not a valid e-mail address: "
        "An email address must have an @-sign.)",
    ),
    "SMS destination that is not E.164": (
        _reminder(channel="sms", destination="555-1234", payload={"body": "b"}),
        "line 2: destination refused (not an E.164 phone number",
    ),
    "reminder id with a space and a non-ASCII letter": (
        _reminder(id="clinic 42 daily café"),
        "line 2: id: use 1 to 200 characters: ASCII letters and digits, '.', '_', ':' and '-'",
    ),
    "payload containing NUL": (
        _reminder(payload={"text": "a\u0000b"}),
        "line 2: payload.text: contains a NUL character (\\u0000)",
    ),
    "payload nested 100,000 deep": (
        json.dumps(_reminder(payload="DEEP")).replace('"DEEP"', _deep_json(100_000)),
        "line 2: nested deeper than 32 levels",
    ),
    "e-mail payload without a subject": (
        _reminder(channel="email", destination="a@example.com", payload={"text": "t"}),
        "line 2: payload: 'subject' is required for e-mail",
    ),
    "SMS body over 1,600 characters": (
        _reminder(channel="sms", destination="+14155550123", payload={"body": "é" * 1601}),
        "line 2: payload.body: too long (1,601 UTF-16 units; the SMS limit is 1,600)",
    ),
    "private destination without an allowlist": (
        _reminder(destination="http://10.1.2.3/hooks"),
        "line 2: destination refused (ssrf: private address)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(ROWS), ids=list(ROWS))
async def test_bad_line_is_refused_at_load_and_the_table_is_unchanged(
    settings: Settings,
    pool: asyncpg.Pool,
    loaded: tuple[int, str],
    tmp_path: Path,
    row: str,
) -> None:
    bad, expected = ROWS[row]
    # Without an allowlist the good lines need a public address (a literal: no DNS).
    allow = "" if "private" in row else "127.0.0.0/8"
    where = "https://1.1.1.1/hooks" if not allow else "http://127.0.0.1:9/hooks"
    path = tmp_path / "reminders.jsonl"
    text = bad if isinstance(bad, str) else json.dumps(bad)
    path.write_text(f"{rs.line('good-1', where)}\n{text}\n{rs.line('good-2', where)}\n")
    result = await rs.relay(settings, "reminders", "load", str(path), ALLOW_NETWORKS=allow)
    assert result.code == errors.ExitCode.CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"relay: bad input: {lines[0].removeprefix('relay: bad input: ')}"]
    assert expected in lines[0], lines[0]
    assert lines[0].endswith("; nothing was loaded")
    assert "Traceback" not in result.stderr
    assert await _table(pool) == loaded


async def test_invalid_utf8_is_reported_with_its_line_and_column(
    settings: Settings, pool: asyncpg.Pool, loaded: tuple[int, str], tmp_path: Path
) -> None:
    path = tmp_path / "reminders.jsonl"
    good = rs.line("good-1", "http://127.0.0.1:9/hooks/a").encode()
    bad = b'{"id": "r-\xff", "channel": "webhook"}'
    path.write_bytes(good + b"\n" + good.replace(b"good-1", b"good-2") + b"\n" + bad + b"\n")
    result = await rs.relay(settings, "reminders", "load", str(path))
    assert result.code == errors.ExitCode.CONFIG
    assert result.stderr.strip() == (
        "relay: bad input: line 3: not valid UTF-8 (byte 0xff at column 11); nothing was loaded"
    )
    assert await _table(pool) == loaded


async def test_several_bad_lines_are_each_named_then_one_summary(
    settings: Settings, pool: asyncpg.Pool, loaded: tuple[int, str]
) -> None:
    lines = [
        json.dumps(_reminder(id="a b")),
        json.dumps(_reminder(id="ok-2", payload={"text": "\u0000"})),
        rs.line("ok-3", "http://127.0.0.1:9/hooks/a"),
    ]
    result = await rs.relay(settings, "reminders", "load", "-", stdin="\n".join(lines))
    assert result.code == errors.ExitCode.CONFIG
    assert result.stderr.strip().splitlines() == [
        "relay: bad input: line 1: id: use 1 to 200 characters: ASCII letters and digits, "
        "'.', '_', ':' and '-'",
        "relay: bad input: line 2: payload.text: contains a NUL character (\\u0000)",
        "relay: bad input: nothing was loaded (2 bad lines)",
    ]
    assert await _table(pool) == loaded


async def test_the_alphabet_and_the_limits_themselves_load(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """What is at the limits loads: the longest id, a payload 32 levels deep, a webhook body
    of exactly 256 KiB, an SMS body of 1,600 units, an e-mail with a display-less address,
    a file saved with a byte-order mark."""
    webhook = {"blob": ""}
    webhook["blob"] = "x" * (256 * 1024 - len(json.dumps(webhook, separators=(",", ":"))))
    lines = [
        _reminder(id="A-z_0.9:" + "x" * 192),
        _reminder(id="deep", payload=_nested(31)),
        _reminder(id="big", payload=webhook),
        _reminder(id="sms", channel="sms", destination="+14155550123",
                  payload={"body": "é" * 1600}),
        _reminder(id="mail", channel="email", destination="ü@bücher.example",
                  payload={"subject": "s", "text": "t", "html": "<p>t</p>"}),
    ]  # fmt: skip
    path = tmp_path / "reminders.jsonl"
    path.write_text("\ufeff" + "\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    result = await rs.relay(settings, "reminders", "load", str(path))
    assert result.code == 0, result.stderr
    assert await pool.fetchval("SELECT count(*) FROM reminders") == len(lines)
