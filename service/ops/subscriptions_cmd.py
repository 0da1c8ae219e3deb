"""``relay destinations subscribe`` and ``unsubscribe`` (``service.subscriptions``).

``subscribe`` adds a subscription (or replaces its filter and budget) and, only with
``--backfill-since``, owes the destination the matching events already recorded; the
next ``relay publish`` sends them. ``unsubscribe`` removes one; deliveries already owed
stay owed (cancel them through their run or replay tools as usual).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from service import destination_switch, entry, errors, retention, subscriptions
from service.clock import SystemClock
from service.ops import deliveries as deliveries_cmd
from service.ops import destinations as destinations_cmd
from service.settings import Settings


def _print(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _url(args: argparse.Namespace, settings: Settings) -> str:
    """The argument's URL, normalised, checked as every destinations command checks it."""
    return destination_switch.target(args.url, destinations_cmd.allowed_networks(settings))


def _missing(url: str) -> int:
    print(f"relay: no destination {url} (register it with `relay destinations add`)",
          file=sys.stderr)  # fmt: skip
    return errors.ExitCode.INCOMPLETE


async def subscribe(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    filter_ = subscriptions.parse_filter(args.filter)
    since = entry.option_time(args.backfill_since, "--backfill-since")
    until = entry.option_time(args.backfill_until, "--backfill-until")
    if until is not None and since is None:
        raise errors.ConfigError("--backfill-until: only with --backfill-since")
    until = until or SystemClock().now()
    if since is not None and since >= until:
        raise errors.ConfigError("--backfill-since: must be before --backfill-until (or now)")
    async with deliveries_cmd.open_pool(settings) as pool, pool.acquire() as conn:
        if since is not None:
            reached = await retention.horizon(conn)
            retention.refuse_reaching_back(
                since,
                reached.event_content_purged_before,
                "--backfill-since",
                "events cannot be sent again: their payloads were purged",
            )
        async with conn.transaction():
            done = await subscriptions.subscribe(conn, url, args.type, filter_, args.budget)
            if done is None:
                return _missing(url)
            owed = (
                await subscriptions.backfill(conn, url, args.type, since, until)
                if since is not None
                else []
            )
    data = {
        "url": url,
        "type": args.type,
        "filter": filter_,
        "budget": args.budget or "webhook",
        "added": done.added,
        "backfilled": len(owed),
    }
    verb = "subscribed" if done.added else "subscription updated:"
    text = (
        f"{verb} {url} to {args.type} ({subscriptions.describe_filter(filter_)}, budget "
        f"{data['budget']}): events recorded from now on"
    )
    if since is not None:
        text += f"; {len(owed)} earlier events owed (backfill), sent by the next relay publish"
    _print(args, data, text)
    return errors.ExitCode.OK


async def unsubscribe(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    async with deliveries_cmd.open_pool(settings) as pool:
        done = await subscriptions.unsubscribe(pool, url, args.type)
    if not done:
        print(f"relay: {url} has no subscription {args.type!r} (see `relay destinations show`)",
              file=sys.stderr)  # fmt: skip
        return errors.ExitCode.INCOMPLETE
    _print(
        args,
        {"url": url, "type": args.type, "removed": True},
        f"unsubscribed {url} from {args.type}: no new events; deliveries already owed stay owed",
    )
    return errors.ExitCode.OK
