"""Handlers of ``relay publish``, ``relay rescue`` and ``relay replay``."""

from __future__ import annotations

import argparse
from datetime import datetime

from publisher import run as publish_run
from service import errors, telemetry
from service.clock import SystemClock
from service.settings import Settings


def _parse_time(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise errors.ConfigError(f"{name}: not an ISO 8601 time: {value!r}") from None
    if parsed.tzinfo is None:
        raise errors.ConfigError(f"{name}: needs a UTC offset, e.g. {value}+00:00")
    return parsed


async def publish(args: argparse.Namespace, settings: Settings) -> int:
    result = await publish_run.run(
        settings,
        metrics=telemetry.noop(),
        clock=SystemClock(),
        intended_fire_at=_parse_time(args.scheduled_at, "--scheduled-at"),
    )
    c = result.counts
    print(
        f"run {result.run_id} {result.status}: due={c.due} created={c.created} "
        f"skipped={c.skipped} published={c.published} rescued={c.rescued} "
        f"left_pending={c.failed}" + (f" ({result.error})" if result.error else "")
    )
    return result.exit_code


async def rescue(args: argparse.Namespace, settings: Settings) -> int:
    raise NotImplementedError


async def replay(args: argparse.Namespace, settings: Settings) -> int:
    raise NotImplementedError
