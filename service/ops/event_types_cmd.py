"""``relay event-types``: the catalogue of event types (``service.events``).

``add`` creates a type or changes its description and JSON Schema (what it is not given is
kept); ``list`` prints every type with how many destinations take it; ``show`` one type
with its schema and the subscriptions that take it. Each prints text or, with ``--json``,
one JSON object. A schema that is not valid JSON Schema is exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from service import errors, events, subscriptions
from service.ops import deliveries as deliveries_cmd
from service.settings import Settings


def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _print(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, default=_plain, indent=2) if args.json else text)


def _read_schema(path: str) -> Any:
    """The JSON in ``path`` (``-``: stdin); unreadable or not JSON is exit 2."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.InputError(f"--schema: cannot read {path}: {type(exc).__name__}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise errors.InputError(f"--schema: {path} is not JSON: {exc}") from None


async def add(args: argparse.Namespace, settings: Settings) -> int:
    loaded = _read_schema(args.schema) if args.schema is not None else None
    async with deliveries_cmd.open_pool(settings) as pool:
        existing = await events.types(pool, args.name)
        before: dict[str, Any] = existing[0] if existing else {"description": "", "schema": None}
        description: str = (
            args.description if args.description is not None else before["description"]
        )
        schema: Any = (
            None if args.no_schema else loaded if args.schema is not None else before["schema"]
        )
        try:
            done = await events.add_type(pool, args.name, description, schema)
        except ValueError as exc:
            raise errors.InputError(str(exc)) from None
    _print(
        args,
        {"name": args.name, "result": done, "schema": schema is not None},
        f"{done} event type {args.name}"
        + (" (payloads checked against its JSON Schema)" if schema is not None else ""),
    )
    return errors.ExitCode.OK


def _line(t: dict[str, Any]) -> str:
    schema = "schema" if t["schema"] is not None else "no schema"
    about = f"  {t['description']}" if t["description"] else ""
    return f"{t['name']:<40} {schema:<9}  {t['subscribers']:>4} destinations{about}"


async def list_(args: argparse.Namespace, settings: Settings) -> int:
    async with deliveries_cmd.open_pool(settings) as pool:
        found = await events.types(pool)
    _print(args, {"event_types": found}, "\n".join(map(_line, found)) or "no event types")
    return errors.ExitCode.OK


async def show(args: argparse.Namespace, settings: Settings) -> int:
    async with deliveries_cmd.open_pool(settings) as pool:
        found = await events.types(pool, args.name)
        taken = await events.subscribers(pool, args.name) if found else []
    if not found:
        print(f"relay: no event type {args.name} (add it with `relay event-types add`)",
              file=sys.stderr)  # fmt: skip
        return errors.ExitCode.INCOMPLETE
    data = found[0] | {"subscriptions": taken}
    lines = [_line(data)]
    if data["schema"] is not None:
        lines.append("  schema: " + json.dumps(data["schema"], sort_keys=True))
    for s in taken:
        state = "" if s["state"] == "enabled" else " (disabled: its deliveries are held)"
        lines.append(
            f"  destination {s['destination_id']} {s['url']}{state}: {s['pattern']}, "
            f"{subscriptions.describe_filter(s['filter'])}, budget {s['provider'] or 'webhook'}"
        )
    if not taken:
        lines.append("  no destination subscribes to it")
    _print(args, data, "\n".join(lines))
    return errors.ExitCode.OK
