"""What operator output may show of a recipient and of text from outside: the one place
both the CLI (``relay deliveries show`` / ``list``) and the console (its pages and
``/api/v1``) go through, so the two redact exactly alike (tests/unit/test_redaction.py
runs both against the same cases).

A webhook destination is shown as its scheme and host (the path and query often carry a
partner's token); an e-mail address or a phone number not at all. Text from outside (a
partner's reply, an error) has every address-like part replaced (``service.logs.redact``),
is flattened to one line and cut to ``EXCERPT_LIMIT`` characters.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from service import logs

EXCERPT_LIMIT = 200  # characters of a provider reply or an error shown per attempt


def destination(channel: str | None, address: str | None) -> str | None:
    """What may be shown of a destination: a webhook's scheme and host, nothing else.

    ``channel`` None (a disabled destination no reminder names any more): a URL is taken
    as a webhook, anything else as a recipient not shown.
    """
    if address is None:
        return None
    if channel is None and "://" not in address:
        return "(recipient not shown)"
    if channel not in (None, "webhook"):
        return f"({channel} recipient not shown)"
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or "?"
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def text(value: str | None, limit: int = EXCERPT_LIMIT) -> str | None:
    """Text from outside (a reply, an error) made safe to show: redacted, one line, cut."""
    if value is None:
        return None
    flat = " ".join(logs.redact(value).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
