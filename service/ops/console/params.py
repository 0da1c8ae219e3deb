"""Reading the console's query and form fields: bad input is a 400 naming the field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from service.ops.console import actions, data

_REF = re.compile(r"^[0-9a-f]{16}$")


def bad(field: str, why: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=f"{field}: {why}")


def optional_int(fields: Mapping[str, Any], name: str) -> int | None:
    raw = str(fields.get(name, "") or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise bad(name, "not a whole number")
    return int(raw)


def choice(fields: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> str | None:
    raw = str(fields.get(name, "") or "").strip()
    if not raw:
        return None
    if raw not in allowed:
        raise bad(name, f"one of {', '.join(allowed)}")
    return raw


def ref(raw: str | None, name: str = "destination") -> str | None:
    if not raw:
        return None
    if not _REF.match(raw):
        raise bad(name, "a destination reference (16 hex digits)")
    return raw


def missing_filter(fields: Mapping[str, Any]) -> data.MissingFilter:
    return data.MissingFilter(
        state=choice(fields, "state", data.STATES),
        channel=choice(fields, "channel", data.CHANNELS),
        destination_ref=ref(str(fields.get("destination", "") or "")),
        after_id=optional_int(fields, "after") or 0,
    )


def path_int(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    if not raw.isdigit() or len(raw) > 18:
        raise web.HTTPNotFound()
    return int(raw)


def flag(fields: Mapping[str, Any], name: str) -> bool:
    return str(fields.get(name, "")).lower() in ("1", "true", "yes", "on")


def replay_request(fields: Mapping[str, Any]) -> actions.ReplayRequest:
    """Which dead deliveries a replay form or body names."""
    return actions.ReplayRequest(
        delivery_id=optional_int(fields, "delivery_id"),
        run_id=optional_int(fields, "run_id"),
        channel=choice(fields, "channel", data.CHANNELS),
        source=choice(fields, "source", ("ledger", "queue")) or "ledger",
    )
