"""Reminder files (JSON Lines) and the management operations on reminders.

A file is all-or-nothing: it is read and upserted by ``id`` in chunks of 5,000 lines inside
one transaction; if any line is bad, the command names each bad line (up to 20, with a
count of the rest) and the transaction is rolled back, so nothing is loaded.
"""

from __future__ import annotations

import asyncio
import itertools
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


class Problems:
    """Bad lines found so far: the first ones kept (for the report), all of them counted."""

    def __init__(self, keep: int = 1000) -> None:
        self.kept: list[tuple[int, str]] = []
        self.count = 0
        self._keep = keep

    def add(self, number: int, text: str) -> None:
        self.count += 1
        if len(self.kept) < self._keep:
            self.kept.append((number, f"line {number}: {text}"))

    def raise_if_any(self) -> None:
        if not self.count:
            return
        shown = [text for _, text in sorted(self.kept)[:MAX_REPORTED_ERRORS]]
        more = self.count - len(shown)
        tail = [f"... and {more} more bad lines"] if more else []
        raise errors.InputError("\n".join([*shown, *tail, "nothing was loaded"]))


def parse_lines(
    numbered: Iterable[tuple[int, str]],
    now: datetime,
    allow: netpolicy.AllowList,
    seen: set[str],
    problems: Problems,
) -> list[Prepared]:
    """Validate lines without network access; bad ones go to ``problems``. ``seen`` holds
    the ids of earlier lines, across chunks of one file."""
    prepared: list[Prepared] = []
    for number, raw in numbered:
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.add(number, f"not valid JSON ({exc.msg})")
            continue
        if not isinstance(data, dict):
            problems.add(number, "expected a JSON object")
            continue
        try:
            line = ReminderLine.model_validate(data)
        except ValidationError as exc:
            problems.add(number, _describe(exc))
            continue
        except schedule.ScheduleError as exc:
            problems.add(number, str(exc))
            continue
        if line.id in seen:
            problems.add(number, f"id {line.id!r} appears twice in the file")
            continue
        seen.add(line.id)
        if line.channel == "webhook":
            problem = netpolicy.url_problem(line.destination, allow)
            if problem:
                problems.add(number, f"destination refused ({problem})")
                continue
        sched = line.schedule()
        first = schedule.first_occurrence(sched, now)
        prepared.append(Prepared(number, line, first, sched.daily_at))
    return prepared


async def check_destinations(
    items: list[Prepared],
    allow: netpolicy.AllowList,
    verdicts: dict[tuple[str, int], str | None],
    problems: Problems,
) -> None:
    """Resolve each webhook host once per file (``verdicts`` caches it); refuse lines whose
    host resolves to a refused address. A name that does not resolve now is let through:
    the connect-time check in the webhook adapter decides when it is used."""
    for item in items:
        if item.line.channel != "webhook":
            continue
        parts = urlsplit(item.line.destination)
        target = (parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        if target not in verdicts:
            try:
                await asyncio.wait_for(netpolicy.resolve_and_check(*target, allow), 5)
                verdicts[target] = None
            except netpolicy.DestinationRefused as exc:
                verdicts[target] = str(exc)
            except (OSError, TimeoutError):
                verdicts[target] = None
        if verdicts[target] is not None:
            problems.add(item.number, f"destination refused ({verdicts[target]})")


async def load(
    pool: asyncpg.Pool,
    lines: Iterable[str],
    allow: netpolicy.AllowList,
    now: datetime | None = None,
) -> int:
    """Validate and upsert a whole file in one transaction; return the number of lines.

    Lines are read, checked and written in chunks, so memory stays flat however long the
    file; the first bad line stops the writing (checking goes on, to report every bad
    line) and the transaction is rolled back: all or nothing.
    """
    when = now or datetime.now(UTC)
    problems = Problems()
    seen: set[str] = set()
    verdicts: dict[tuple[str, int], str | None] = {}
    loaded = 0
    numbered = enumerate(lines, start=1)
    async with pool.acquire() as conn, conn.transaction():
        while chunk := list(itertools.islice(numbered, UPSERT_BATCH)):
            items = parse_lines(chunk, when, allow, seen, problems)
            await check_destinations(items, allow, verdicts, problems)
            if not problems.count and items:
                await conn.execute(db.q("upsert_reminders"), *_columns(items))
                loaded += len(items)
        problems.raise_if_any()  # raising inside the block rolls the transaction back
    return loaded


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
