"""Structured logs: one JSON object per line with a constant message and an ``event``.

Lines about a delivery carry ``delivery_id``, ``key``, ``run_id`` and ``attempt`` so they
join with the ledger. Recipient addresses, payloads and secrets are never logged: callers
pass identifiers only, and ``redact`` guards the few places where text from outside
(an error message, say) reaches a log line.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from pythonjsonlogger.json import JsonFormatter

_EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
_PHONE = re.compile(r"\+\d{7,15}")


def redact(text: str) -> str:
    """Strip anything that looks like an address (URL, e-mail, phone number)."""
    text = _URL.sub("<url>", text)
    text = _EMAIL.sub("<email>", text)
    return _PHONE.sub("<phone>", text)


# The libraries whose own lines reach our stream. Each is reset to propagate to the root
# handler below, so a handler one of them (or an application) attached cannot print plain
# text beside the JSON lines.
LIBRARY_LOGGERS = ("aio_pika", "aiormq", "asyncio", "aiohttp", "asyncpg")


class RelayJsonFormatter(JsonFormatter):
    """JSON lines whose ``time`` is RFC 3339 in UTC with milliseconds (``...T04:07:34.636Z``)."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{seconds}.{int(record.msecs):03d}Z"


def formatter() -> logging.Formatter:
    """The one formatter every log line of a relay process goes through."""
    return RelayJsonFormatter(
        "{asctime}{levelname}{name}{message}",
        style="{",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


def setup(level: str = "INFO", stream: Any = None) -> None:
    """Send every ``relay.*`` logger's records, and the libraries', to ``stream`` as JSON."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter())
    root = logging.getLogger("relay")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # Libraries (asyncpg, aiormq, aio-pika, aiohttp) log through the root logger: the same
    # JSON lines, warnings and worse only, so a stream holds nothing but JSON.
    libraries = logging.getLogger()
    libraries.handlers[:] = [handler]
    libraries.setLevel(logging.WARNING)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
    # Python's own warnings (deprecations and the like) become JSON lines too, not text.
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").handlers.clear()


def get(name: str) -> logging.Logger:
    """A logger under ``relay.``."""
    return logging.getLogger(f"relay.{name}")


# A condition repeating per message (a channel not configured, a held destination) logs at
# INFO or ERROR once per reason in this many seconds, the rest at DEBUG or not at all.
REPEAT_EVERY_SECONDS = 60.0


class OnePerInterval:
    """The first line of each kind per interval, and how many were held back before it.

    For a condition that repeats once per message: a disabled destination's thousands of
    held deliveries are re-checked every half minute, and one INFO line each would bury
    everything else. The caller logs an admitted line at its level (with the count held
    back) and the others at DEBUG, or not at all.
    """

    _MAX_KINDS = 1_000  # kinds are fixed phrases; a bound anyway

    def __init__(self, seconds: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._seconds = seconds
        self._now = monotonic
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, logger: logging.Logger, kind: str, message: str, fields: dict[str, Any]) -> None:
        """``message`` at INFO if admitted, with ``held_back``; else at DEBUG."""
        held_back = self.admit(kind)
        level = logging.DEBUG if held_back is None else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, message, extra={**fields, "held_back": held_back or 0})

    def admit(self, kind: str) -> int | None:
        """None: hold this line back; else how many of its kind were held back since the
        last one admitted."""
        now = self._now()
        last = self._last.get(kind)
        if last is not None and now - last < self._seconds:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        if len(self._last) >= self._MAX_KINDS:
            self._last.clear()
        self._last[kind] = now
        return self._held.pop(kind, 0)
