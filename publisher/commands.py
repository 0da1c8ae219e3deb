"""Handlers of ``relay publish``, ``relay rescue`` and ``relay replay``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import datetime
from typing import Any

from publisher import backfill as backfill_mod
from publisher import drop as drop_mod
from publisher import replay as replay_mod
from publisher import run as publish_run
from publisher.results import RunResult
from service import entry, errors, telemetry
from service.clock import SystemClock
from service.ledger import State
from service.settings import Settings


def _print_run(result: RunResult) -> None:
    c = result.counts
    print(
        f"run {result.run_id} {result.status}: due={c.due} created={c.created} "
        f"skipped={c.skipped} published={c.published} rescued={c.rescued} "
        f"left_pending={c.failed}" + (f" ({result.error})" if result.error else "")
    )


async def _run(settings: Settings, *, rescue_only: bool, intended: datetime | None) -> int:
    # Short-lived: metrics and spans are pushed by OTLP when an endpoint is configured
    # (OTEL_EXPORTER_OTLP_ENDPOINT) and flushed before exit; the run is in the ledger anyway.
    telem = telemetry.setup("relay-publish")
    try:
        result = await publish_run.run(
            settings,
            metrics=telem.metrics,
            clock=SystemClock(),
            intended_fire_at=intended,
            rescue_only=rescue_only,
            tracer=telem.tracer,
        )
    finally:
        telem.shutdown()
    _print_run(result)
    return result.exit_code


async def publish(args: argparse.Namespace, settings: Settings) -> int:
    return await _run(
        settings, rescue_only=False, intended=entry.option_time(args.scheduled_at, "--scheduled-at")
    )


async def rescue(args: argparse.Namespace, settings: Settings) -> int:
    return await _run(settings, rescue_only=True, intended=None)


async def replay(args: argparse.Namespace, settings: Settings) -> int:
    if args.apply and args.dry_run:
        raise errors.ConfigError("--apply and --dry-run: choose one")
    if args.limit < 1:
        raise errors.ConfigError("--limit: must be at least 1")
    names = tuple(args.state or ["dead"])
    replayable = {s.value for s in replay_mod.REPLAYABLE}
    bad = [s for s in names if s not in replayable]
    if bad:
        raise errors.ConfigError(
            f"--state: {', '.join(bad)} cannot be replayed "
            f"(choose from {', '.join(sorted(replayable))}; delivered rows never are)"
        )
    filters = replay_mod.LedgerFilter(
        states=tuple(State(s) for s in names),
        since=entry.option_time(args.since, "--since"),
        until=entry.option_time(args.until, "--until"),
        run_id=args.run,
        reminder_id=args.reminder,
        provider=args.provider,
        channel=args.channel,
        key=args.key,
        last_status=args.last_status,
    )
    if args.drop:
        if args.source != "queue":
            raise errors.ConfigError("--drop: only with --from queue (ledger rows are not dropped)")
        dropped = await drop_mod.drop(
            settings,
            operator=args.operator,
            filters=filters,
            states_given=args.state is not None,
            limit=args.limit,
            apply=args.apply,
        )
        print(_json(dropped.as_dict()) if args.json else dropped.render())
        return errors.ExitCode.INCOMPLETE if dropped.interrupted else errors.ExitCode.OK
    telem = telemetry.setup("relay-replay")
    try:
        summary = await replay_mod.run(
            settings,
            metrics=telem.metrics,
            operator=args.operator,
            source=args.source,
            filters=filters,
            limit=args.limit,
            apply=args.apply,
        )
    finally:
        telem.shutdown()
    print(_json(dataclasses.asdict(summary)) if args.json else summary.render())
    complete = summary.failed == 0 and not summary.interrupted
    return errors.ExitCode.OK if complete else errors.ExitCode.INCOMPLETE


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, default=_iso, indent=2, sort_keys=True)


def _iso(value: object) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


async def backfill(args: argparse.Namespace, settings: Settings) -> int:
    start = entry.option_time(args.start, "--from")
    assert start is not None
    end = entry.option_time(args.end, "--to") or datetime.now(start.tzinfo)
    if end < start:
        raise errors.ConfigError("--to: before --from")
    if args.publish and not args.apply:
        raise errors.ConfigError("--publish: only with --apply")
    summary = await backfill_mod.run(
        settings,
        reminder_id=None if args.all else args.reminder,
        start=start,
        end=end,
        apply=args.apply,
        publish_now=args.publish,
    )
    print(_json(summary.as_dict()) if args.json else summary.render())
    complete = summary.failed == 0 and not summary.interrupted
    return errors.ExitCode.OK if complete else errors.ExitCode.INCOMPLETE
