"""``relay erase --recipient ADDRESS|NUMBER|URL``: answer an erasure request.

A dry run unless ``--apply`` (as ``destinations enable``, ``runs cancel`` and ``replay``):
it prints, per table, how many rows the erasure changes, and the earlier erasures of the
same recipient. ``--apply`` (with ``--reason``) does it in one transaction and records it
in ``erasures`` under the recipient's keyed hash: the console's destination reference
(``service.ops.console.refs``, keyed with the deployment's secret), never the recipient.
Refused with exit 4, nothing changed, while one of the recipient's deliveries is being
sent. Neither the output nor the log line names the recipient.
"""

from __future__ import annotations

import argparse
import sys

from service import erasure, erasure_recipient, errors, logs
from service.ops import deliveries
from service.ops.console import refs
from service.settings import Settings

log = logs.get("erase")


async def erase(args: argparse.Namespace, settings: Settings) -> int:
    if args.apply and args.dry_run:
        raise errors.ConfigError("--apply and --dry-run: choose one")
    recipient = erasure_recipient.parse(args.recipient)
    async with deliveries.open_pool(settings) as pool, pool.acquire() as conn:
        key = await refs.load(conn)
        try:
            done = await erasure.erase(
                conn,
                recipient,
                recipient_ref=key.of(recipient.address),
                operator=args.operator,
                reason=args.reason,
                apply=args.apply,
            )
        except erasure.InFlight as exc:
            print(f"relay: {exc}", file=sys.stderr)
            return errors.ExitCode.IN_FLIGHT
    if done.applied:
        log.info(
            "recipient erased",
            extra={
                "event": "erasure",
                "erasure_id": done.erasure_id,
                "channel": done.channel,
                "recipient_ref": done.recipient_ref,
                "rows": done.total,
            },
        )
    print(deliveries.to_json(done.as_dict()) if args.json else render(done))
    return errors.ExitCode.OK


def render(done: erasure.Erasure) -> str:
    """What an erasure did, or in a dry run would do, in words."""
    who = f"{done.channel} recipient {done.recipient_ref}"
    if done.applied:
        lines = [f"erased {who} (erasure {done.erasure_id}): {done.total} rows changed"]
    else:
        lines = [f"erase {who}: dry run, {done.total} rows would change"]
    for table, changes in sorted(done.counts.items()):
        lines.append(f"  {table}: " + ", ".join(f"{n} {what}" for what, n in changes.items()))
    if not done.counts:
        lines.append("  nothing of this recipient is held")
    for e in done.earlier:
        lines.append(f"  erased before: erasure {e.id} at {e.at:%Y-%m-%d %H:%M:%S} by {e.operator}")
    if not done.applied:
        lines.append("  nothing changed; add --apply (with --reason) to do it")
    return "\n".join(lines)
