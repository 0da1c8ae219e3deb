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


def setup(level: str = "INFO", stream: Any = None) -> None:
    """Send every ``relay.*`` logger's records to ``stream`` as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter(
            "{asctime}{levelname}{name}{message}",
            style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            timestamp=False,
        )
    )
    root = logging.getLogger("relay")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # Libraries (asyncpg, aiormq, aio-pika, aiohttp) log through the root logger: the same
    # JSON lines, warnings and worse only, so a stream holds nothing but JSON.
    libraries = logging.getLogger()
    libraries.handlers[:] = [handler]
    libraries.setLevel(logging.WARNING)


def get(name: str) -> logging.Logger:
    """A logger under ``relay.``."""
    return logging.getLogger(f"relay.{name}")
