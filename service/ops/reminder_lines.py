"""Reading a reminders file (JSON Lines) line by line, before any line is understood.

A line's bytes are bounded (``MAX_LINE_BYTES``: longer ones are refused unread), decoded
as UTF-8 and parsed as one JSON object whose nesting is bounded before parsing, so no
line can exhaust memory or the parser's recursion. A file is read in chunks (at most
``UPSERT_BATCH`` lines and about ``CHUNK_BYTES`` of text). Every bad line goes to
``Problems``, the report that names them (``service.ops.reminders`` then checks what
each object says).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, BinaryIO

from service import entry, errors, limits

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


def decode(number: int, raw: str | bytes, problems: Problems) -> str | None:
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


def parse_json(number: int, text: str, problems: Problems) -> dict[str, Any] | None:
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


def read_lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of a binary stream; a line longer than ``MAX_LINE_BYTES`` is cut to its
    first ``MAX_LINE_BYTES + 1`` bytes (the rest is skipped, never held in memory), which
    ``parse_lines`` refuses as too long."""
    while line := stream.readline(MAX_LINE_BYTES + 1):
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := stream.readline(64 * 1024)) and not rest.endswith(b"\n"):
                pass
        yield line


def chunks(
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
