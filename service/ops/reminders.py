"""Reminder files (JSON Lines) and the management operations on reminders.

A file is all-or-nothing: it is read and upserted by ``id`` in chunks (5,000 lines, or
fewer when they are long) inside one transaction; if any line is bad, the command names
each bad line (up to 20, with a count of the rest) and the transaction is rolled back, so
nothing is loaded.

Each line is checked by ``service.entry``, the same door the outbox API uses: its bytes
(UTF-8, at most ``MAX_LINE_BYTES``), its JSON (no NaN, nesting bounded, no NUL), the
reminder's fields, its destination (the destination policy, e-mail syntax, E.164) and its
payload (the channel's keys and send-time size).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any, BinaryIO, Literal

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

from service import db, destinations, edits, entry, errors, limits, netpolicy, schedule
from service.progress import Progress

MAX_REPORTED_ERRORS = 20
UPSERT_BATCH = 5000  # lines per chunk, at most
CHUNK_BYTES = 32 * 1024 * 1024  # and at most this much text per chunk
# A line may be at most this long: a payload at the largest send-time limit, written with
# every character escaped (\uXXXX), still fits. Longer lines are refused unread.
MAX_LINE_BYTES = 4 * 1024 * 1024
_BOM = "\ufeff"
_TOO_LONG = (
    f"longer than {MAX_LINE_BYTES:,} bytes, so its payload is over every channel's limit "
    f"(at most {limits.MAX_PAYLOAD_BYTES:,} bytes as JSON)"
)


class ReminderLine(BaseModel):
    """One line of a reminders file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    channel: Literal["webhook", "email", "sms"]
    destination: str = Field(min_length=1, max_length=entry.MAX_DESTINATION_CHARS)
    payload: dict[str, Any]
    due_at: AwareDatetime | None = None
    daily_at: str | None = None
    cron: str | None = None
    timezone: str = "UTC"
    missed_policy: Literal["catch_up", "latest", "skip"] = "catch_up"
    stale_after: timedelta | None = None  # seconds or ISO 8601 duration ("PT2H")
    send_stale: bool = False
    urgent: bool = False
    provider: str | None = None
    event_type: str | None = None  # the envelope's type (default reminder.due)
    # None: a new reminder is active, an existing one keeps its state (a cancelled one
    # stays cancelled); False: cancel it; True: revive it if it was cancelled. A webhook
    # reminder whose destination is disabled is paused whatever this says.
    active: bool | None = None

    @field_validator("id")
    @classmethod
    def _id_alphabet(cls, value: str) -> str:
        problem = entry.identifier_problem(value, entry.MAX_REMINDER_ID_CHARS)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("provider")
    @classmethod
    def _provider_name(cls, value: str | None) -> str | None:
        problem = None if value is None else entry.provider_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("event_type")
    @classmethod
    def _event_type(cls, value: str | None) -> str | None:
        problem = None if value is None else entry.event_type_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("due_at")
    @classmethod
    def _due_at_in_calendar(cls, value: datetime | None) -> datetime | None:
        if value is not None:
            try:
                value.astimezone(UTC)
            except OverflowError:
                raise ValueError("outside the calendar (years 1 to 9999 in UTC)") from None
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
        """Raise InputError: one line per bad line shown, then one saying nothing was
        loaded (a single bad line is one line: ``line 3: ...; nothing was loaded``)."""
        if not self.count:
            return
        shown = [text for _, text in sorted(self.kept)[:MAX_REPORTED_ERRORS]]
        if self.count == 1:
            raise errors.InputError(f"{shown[0]}; nothing was loaded")
        more = self.count - len(shown)
        tail = [f"... and {more} more bad lines"] if more else []
        summary = f"nothing was loaded ({self.count:,} bad lines)"
        raise errors.InputError("\n".join([*shown, *tail, summary]))


def _decode(number: int, raw: str | bytes, problems: Problems) -> str | None:
    """The text of one line, or None (blank, or bad: then reported)."""
    if isinstance(raw, bytes):
        if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
            problems.add(number, _TOO_LONG)
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            byte = raw[exc.start]
            problems.add(number, f"not valid UTF-8 (byte 0x{byte:02x} at column {exc.start + 1})")
            return None
    else:
        text = raw
        if len(text) > MAX_LINE_BYTES:
            problems.add(number, _TOO_LONG)
            return None
    if number == 1:
        text = text.removeprefix(_BOM)  # a byte-order mark some editors write
    return text if text.strip() else None


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _parse_json(number: int, text: str, problems: Problems) -> dict[str, Any] | None:
    """The line's object, or None (reported): nesting is bounded before parsing, so no
    line can exhaust the parser's recursion."""
    depth = limits.MAX_PAYLOAD_DEPTH + 1  # the line's object holds the payload
    if text.count("[") + text.count("{") > depth and entry.json_depth(text) > depth:
        problems.add(number, f"nested deeper than {limits.MAX_PAYLOAD_DEPTH} levels")
        return None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        problems.add(number, f"not valid JSON ({exc.msg} at column {exc.colno})")
        return None
    except ValueError as exc:  # NaN or Infinity, an integer of more than 4,300 digits
        problems.add(number, f"not valid JSON ({exc})")
        return None
    if not isinstance(data, dict):
        problems.add(number, "expected a JSON object")
        return None
    for key, value in data.items():
        problem = entry.text_problem(key)
        if problem is None:
            problem = entry.value_problem(value, key, limits.MAX_PAYLOAD_DEPTH)
        else:
            problem = f"a key {problem}"
        if problem is not None:
            problems.add(number, problem)
            return None
    return data


def parse_lines(
    numbered: Iterable[tuple[int, str | bytes]],
    now: datetime,
    allow: netpolicy.AllowList,
    seen: set[str],
    problems: Problems,
) -> list[Prepared]:
    """Validate lines without network access; bad ones go to ``problems``. ``seen`` holds
    the ids of earlier lines, across chunks of one file."""
    prepared: list[Prepared] = []
    for number, raw in numbered:
        text = _decode(number, raw, problems)
        if text is None:
            continue
        data = _parse_json(number, text, problems)
        if data is None:
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
        problem = entry.destination_problem(line.channel, line.destination, allow)
        if problem is not None:
            problems.add(number, f"destination refused ({problem})")
            continue
        problem = entry.payload_problem(line.channel, line.payload, line.destination)
        if problem is not None:
            problems.add(number, problem)
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
        problem = await entry.resolved_problem(item.line.destination, allow, verdicts)
        if problem is not None:
            problems.add(item.number, f"destination refused ({problem})")


def read_lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of a binary stream; a line longer than ``MAX_LINE_BYTES`` is cut to its
    first ``MAX_LINE_BYTES + 1`` bytes (the rest is skipped, never held in memory), which
    ``parse_lines`` refuses as too long."""
    while line := stream.readline(MAX_LINE_BYTES + 1):
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := stream.readline(64 * 1024)) and not rest.endswith(b"\n"):
                pass
        yield line


def _chunks(
    numbered: Iterator[tuple[int, str | bytes]],
) -> Iterator[list[tuple[int, str | bytes]]]:
    """At most UPSERT_BATCH lines and about CHUNK_BYTES of text at a time."""
    chunk: list[tuple[int, str | bytes]] = []
    size = 0
    for item in numbered:
        chunk.append(item)
        size += len(item[1])
        if len(chunk) >= UPSERT_BATCH or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


async def load(
    pool: asyncpg.Pool,
    lines: Iterable[str | bytes],
    allow: netpolicy.AllowList,
    now: datetime | None = None,
    registration: destinations.Registration | None = None,
    tally: edits.Tally | None = None,
) -> int:
    """Validate and upsert a whole file in one transaction; return the number of lines
    (``tally``, if given: the schedule edits, what they skipped, lines of erased reminders).

    ``lines`` are text, or bytes (decoded here as UTF-8, so an invalid byte is reported
    with its line). Lines are read, checked and written in chunks, so memory stays flat
    however long the file; the first bad line stops the writing (checking goes on, to
    report every bad line) and the transaction is rolled back: all or nothing.
    """
    problems = Problems()
    seen: set[str] = set()
    verdicts: dict[tuple[str, int], str | None] = {}
    loaded = 0
    progress = Progress("load")  # on stderr, only when it is a terminal
    async with pool.acquire() as conn, conn.transaction():
        # One instant for the whole edit: first occurrences, schedule history, and which
        # admitted occurrences a changed schedule still owes (the database's clock).
        when: datetime = now or await conn.fetchval(db.q("db_now"))
        for chunk in _chunks(enumerate(lines, start=1)):
            items = parse_lines(chunk, when, allow, seen, problems)
            items = await edits.not_erased(conn, items, lambda p: p.line.id, tally)
            await check_destinations(items, allow, verdicts, problems)
            await _enter_destinations(conn, items, registration, problems)
            if not problems.count and items:
                schedules = {p.line.id: p.line.schedule() for p in items}
                edited = await edits.upsert(conn, _columns(items), schedules, when)
                if tally is not None:
                    tally.add(edited)
                ids = [p.line.id for p in items]
                await conn.execute(
                    db.q("reminders_file_state"), ids, [p.line.active for p in items]
                )
                loaded += len(items)
                progress.update(loaded)
        progress.finish()
        problems.raise_if_any()  # raising inside the block rolls the transaction back
    return loaded


async def _enter_destinations(
    conn: destinations.Connection,
    items: list[Prepared],
    registration: destinations.Registration | None,
    problems: Problems,
) -> None:
    """Register the chunk's unknown webhook destinations, or refuse their lines when only
    registered ones may be named (``service.destinations.enter``)."""
    webhooks = [i for i in items if i.line.channel == "webhook"]
    urls = [destinations.normalise(i.line.destination) for i in webhooks]
    refused = await destinations.enter(conn, urls, registration or destinations.Registration())
    for item, url in zip(webhooks, urls, strict=True):
        if url in refused:
            problems.add(item.number, destinations.NOT_REGISTERED)


def _destination(line: ReminderLine) -> str:
    webhook = line.channel == "webhook"
    return destinations.normalise(line.destination) if webhook else line.destination


def _columns(chunk: list[Prepared]) -> list[list[Any]]:
    lines = [p.line for p in chunk]
    return [
        [x.id for x in lines],
        [x.channel for x in lines],
        [_destination(x) for x in lines],
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
        [x.event_type for x in lines],
    ]
