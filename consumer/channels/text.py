"""Pure text helpers for what a provider sends back: headers, bodies, identifiers.

Every HTTP adapter reads an answer the same way: a ``Retry-After`` header into seconds
(:func:`parse_retry_after`), a body into a bounded, log-safe excerpt (:func:`excerpt`)
or a JSON object (:func:`try_json_object`), and a provider's id or error name into a
token with no characters that could forge a log line or a record (:func:`safe_token`).
No I/O and no clock (``now`` is an argument); ``consumer.channels.http`` builds on them
and re-exports them for the adapters.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = ["excerpt", "parse_retry_after", "safe_token", "try_json_object"]


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait according to a Retry-After header value, or None.

    Accepts delta-seconds (``"120"``) and an HTTP-date
    (``"Wed, 21 Oct 2015 07:28:00 GMT"``); a date in the past means 0. Anything
    unparseable, negative or non-finite yields None, leaving the delay to the
    retry policy. No upper cap is applied here: clamping is policy, not parsing.
    A naive ``now`` is taken to be UTC.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # RFC 9110 dates are always GMT
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


def excerpt(data: bytes, limit: int) -> str | None:
    """A log-safe excerpt: at most ``limit`` bytes, decoded with errors='replace'.

    Cutting may split a multi-byte character; that becomes U+FFFD rather than an
    error. Control characters other than tab/newline are replaced too, so an
    excerpt cannot forge log lines or terminal escapes.
    """
    if limit <= 0 or not data:
        return None
    text = data[:limit].decode("utf-8", errors="replace")
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "\ufffd", text)


def try_json_object(data: bytes) -> dict[str, Any] | None:
    """Parse ``data`` as a JSON object, or None if it is not one."""
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9._:/+=-]")


def safe_token(value: object, max_len: int = 128) -> str | None:
    """A provider identifier (message id, error name) reduced to safe characters.

    Provider ids are opaque tokens; anything outside a conservative alphabet is
    dropped so a hostile or buggy response cannot inject text into our records.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    cleaned = _TOKEN_UNSAFE.sub("", str(value))[:max_len]
    return cleaned or None
