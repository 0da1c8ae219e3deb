"""Reminder files (JSON Lines) and the management operations on reminders.

A file is all-or-nothing: every line is validated first, and if any line is bad the
command names each bad line (up to 20) and loads nothing. A good file is upserted by
``id`` in one transaction, in batches of 5,000 rows per statement.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any, Literal
from urllib.parse import urlsplit

import asyncpg
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from service import db, errors, netpolicy, schedule

MAX_REPORTED_ERRORS = 20
UPSERT_BATCH = 5000


class ReminderLine(BaseModel):
    """One line of a reminders file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    channel: Literal["webhook", "email", "sms"]
    destination: str = Field(min_length=1, max_length=2048)
    payload: dict[str, Any]
    due_at: AwareDatetime | None = None
    daily_at: str | None = None
    cron: str | None = None
    timezone: str = "UTC"
    missed_policy: Literal["catch_up", "latest", "skip"] = "catch_up"
    stale_after: timedelta | None = None  # seconds or ISO 8601 duration ("PT2H")
    send_stale: bool = False
    urgent: bool = False
    provider: str | None = Field(default=None, min_length=1, max_length=100)

    @field_validator("destination")
    @classmethod
    def _no_whitespace(cls, value: str) -> str:
        if value != value.strip():
            raise ValueError("must not have leading or trailing spaces")
        return value

    @model_validator(mode="after")
    def _one_schedule(self) -> ReminderLine:
        given = [n for n in ("due_at", "daily_at", "cron") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of due_at, daily_at (with timezone) or cron")
        schedule.validate(self.schedule())
        return self

    def schedule(self) -> schedule.Schedule:
        if self.due_at is not None:
            return schedule.Schedule(kind="once", timezone=self.timezone, due_at=self.due_at)
        if self.daily_at is not None:
            return schedule.Schedule(
                kind="daily",
                timezone=self.timezone,
                daily_at=schedule.parse_daily_at(self.daily_at),
            )
        return schedule.Schedule(kind="cron", timezone=self.timezone, cron=self.cron)


@dataclass(frozen=True)
class Prepared:
    """A validated line with its first occurrence computed."""

    number: int  # line number in the file
    line: ReminderLine
    next_due_at: datetime | None
    daily_at: time | None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def parse_lines(
    lines: Iterable[str], now: datetime, allow: netpolicy.AllowList
) -> tuple[list[Prepared], list[str]]:
    """Validate every line without network access: (good lines, problems by line)."""
    problems: list[str] = []
    seen: set[str] = set()
    prepared: list[Prepared] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not valid JSON ({exc.msg})")
            continue
        if not isinstance(data, dict):
            problems.append(f"line {number}: expected a JSON object")
            continue
        try:
            line = ReminderLine.model_validate(data)
        except ValidationError as exc:
            problems.append(f"line {number}: {_describe(exc)}")
            continue
        except schedule.ScheduleError as exc:
            problems.append(f"line {number}: {exc}")
            continue
        if line.id in seen:
            problems.append(f"line {number}: id {line.id!r} appears twice in the file")
            continue
        seen.add(line.id)
        if line.channel == "webhook":
            problem = netpolicy.url_problem(line.destination, allow)
            if problem:
                problems.append(f"line {number}: destination refused ({problem})")
                continue
        sched = line.schedule()
        first = schedule.first_occurrence(sched, now)
        prepared.append(Prepared(number, line, first, sched.daily_at))
    return prepared, problems


def _raise_if(problems: list[str]) -> None:
    if problems:
        shown = problems[:MAX_REPORTED_ERRORS]
        more = len(problems) - len(shown)
        tail = [f"... and {more} more bad lines"] if more else []
        raise errors.InputError("\n".join([*shown, *tail, "nothing was loaded"]))


async def check_destinations(items: list[Prepared], allow: netpolicy.AllowList) -> list[str]:
    """Resolve each webhook host once; refuse lines whose host resolves to a refused
    address. A name that does not resolve now is let through: the connect-time check
    in the webhook adapter decides when it is used."""
    hosts: dict[tuple[str, int], list[int]] = {}
    for item in items:
        if item.line.channel == "webhook":
            parts = urlsplit(item.line.destination)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            hosts.setdefault((parts.hostname or "", port), []).append(item.number)
    problems: list[str] = []
    for (host, port), numbers in hosts.items():
        try:
            await asyncio.wait_for(netpolicy.resolve_and_check(host, port, allow), 5)
        except netpolicy.DestinationRefused as exc:
            problems += [f"line {n}: destination refused ({exc})" for n in numbers]
        except (OSError, TimeoutError):
            continue
    return problems


async def load(
    pool: asyncpg.Pool,
    lines: Iterable[str],
    allow: netpolicy.AllowList,
    now: datetime | None = None,
) -> int:
    """Validate and upsert a whole file in one transaction; return the number of lines."""
    when = now or datetime.now(UTC)
    items, problems = parse_lines(lines, when, allow)
    problems += await check_destinations(items, allow)
    _raise_if(sorted(problems, key=lambda p: int(p.split(":")[0].removeprefix("line "))))
    async with pool.acquire() as conn, conn.transaction():
        for start in range(0, len(items), UPSERT_BATCH):
            chunk = items[start : start + UPSERT_BATCH]
            await conn.execute(db.q("upsert_reminders"), *_columns(chunk))
    return len(items)


def _columns(chunk: list[Prepared]) -> list[list[Any]]:
    lines = [p.line for p in chunk]
    return [
        [x.id for x in lines],
        [x.channel for x in lines],
        [x.destination for x in lines],
        [x.payload for x in lines],
        [x.schedule().kind for x in lines],
        [x.due_at for x in lines],
        [p.daily_at for p in chunk],
        [x.cron for x in lines],
        [x.timezone for x in lines],
        [x.missed_policy for x in lines],
        [x.stale_after for x in lines],
        [x.send_stale for x in lines],
        [x.urgent for x in lines],
        [x.provider or x.channel for x in lines],
        [p.next_due_at for p in chunk],
    ]
