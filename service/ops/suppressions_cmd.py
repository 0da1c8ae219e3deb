"""``relay suppressions list|add|remove``: the suppression list, for operators.

``list`` prints the addresses and numbers in force (``--all``: lifted ones too), newest
first, with why, when and the delivery whose receipt added each; ``add`` suppresses one by
hand (recorded as ``operator``, with who and why); ``remove`` lifts one (the row stays, with
who lifted it and why). This is the one place an address is printed: to the operator's
terminal, never to a log line.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import Any

from service import errors, logs, suppressions
from service.ops import deliveries, redaction
from service.settings import Settings
from service.suppressions import Suppression

log = logs.get("suppressions")


def _json(row: Suppression) -> dict[str, Any]:
    return dict(row.__dict__)


def _t(value: datetime | None) -> str:
    return "-" if value is None else f"{value:%Y-%m-%d %H:%M:%S}"


def render(rows: list[Suppression]) -> str:
    if not rows:
        return "no suppressions"
    header = (
        f"{'id':>6} {'channel':<7} {'address':<36} {'reason':<13} {'since (UTC)':<19} "
        f"{'delivery':>8}  detail"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        detail = r.detail or ""
        if r.removed_at is not None:
            detail = f"REMOVED {_t(r.removed_at)} by {r.removed_by}: {r.removed_reason}"
        lines.append(
            f"{r.id:>6} {r.channel:<7} {r.address:<36} {r.reason:<13} {_t(r.created_at):<19} "
            f"{r.delivery_id or '-':>8}  {redaction.text(detail, 80)}"
        )
    return "\n".join(lines)


async def list_(args: argparse.Namespace, settings: Settings) -> int:
    if args.limit < 1:
        raise errors.ConfigError("--limit: must be at least 1")
    async with deliveries.open_pool(settings) as pool:
        rows = await suppressions.listed(
            pool, args.channel, include_removed=args.all, limit=args.limit
        )
    if args.json:
        print(deliveries.to_json({"suppressions": [_json(r) for r in rows]}))
    else:
        print(render(rows))
    return errors.ExitCode.OK


def _checked(args: argparse.Namespace) -> None:
    try:
        suppressions.check(args.channel, args.address)
    except suppressions.InvalidSuppression as exc:
        raise errors.InputError(str(exc)) from None
    if not args.reason.strip():
        raise errors.InputError("--reason: say why")


async def add(args: argparse.Namespace, settings: Settings) -> int:
    _checked(args)
    async with deliveries.open_pool(settings) as pool:
        row = await suppressions.add(pool, args.channel, args.address, args.operator, args.reason)
    if row is None:
        print(f"relay: already suppressed on {args.channel}")
        return errors.ExitCode.INCOMPLETE
    log.info(
        "suppression added by an operator",
        extra={"event": "suppression_added", "suppression_id": row.id, "channel": row.channel},
    )
    print(deliveries.to_json(_json(row)) if args.json else f"suppressed: {render([row])}")
    return errors.ExitCode.OK


async def remove(args: argparse.Namespace, settings: Settings) -> int:
    _checked(args)
    async with deliveries.open_pool(settings) as pool:
        row = await suppressions.remove(
            pool, args.channel, args.address, args.operator, args.reason
        )
    if row is None:
        print(f"relay: not suppressed on {args.channel}")
        return errors.ExitCode.INCOMPLETE
    log.info(
        "suppression removed by an operator",
        extra={"event": "suppression_removed", "suppression_id": row.id, "channel": row.channel},
    )
    print(deliveries.to_json(_json(row)) if args.json else f"lifted: {render([row])}")
    return errors.ExitCode.OK
