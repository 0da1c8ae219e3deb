"""The ``relay`` arguments of the operators' commands: ``deliveries``, ``runs`` and
``backfill`` (``service.ops.cli`` adds them to its parser; their handlers are
``service.ops.handlers``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

# cli._command: (subparsers, name, summary, *examples) -> parser
Command = Callable[..., argparse.ArgumentParser]


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document (fields in the README)"
    )


def add_operator(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--operator",
        default=os.environ.get("USER", "unknown"),
        help="who does it, recorded with an applied action (default: $USER)",
    )


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    _add_deliveries(sub, command)
    _add_runs(sub, command)
    _add_backfill(sub, command)


def _add_deliveries(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    dl = command(
        sub,
        "deliveries",
        "one delivery's story, or the deliveries matching filters",
        "relay deliveries show 1234",
        "relay deliveries list --run 42 --state dead",
    )
    dsub = dl.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = command(
        dsub,
        "show",
        "a delivery, its reminder or outbox intent, its run and every attempt",
        "relay deliveries show 1234",
        "relay deliveries show --key reminder:clinic-42-daily:2026-03-02T07:00:00Z:email",
    )
    show.add_argument("id", nargs="?", type=int, default=None, help="the delivery's id")
    show.add_argument("--key", default=None, help="the delivery's idempotency key instead")
    add_json(show)
    lst = command(
        dsub,
        "list",
        "deliveries by state, run, reminder, destination, channel and due time, newest first",
        "relay deliveries list --run 42 --state dead --state retrying",
        "relay deliveries list --since 2026-03-02T00:00:00+00:00 --json",
    )
    lst.add_argument("--state", action="append", default=None, help="this state; repeatable")
    lst.add_argument("--run", type=int, default=None, help="rows of this publish run")
    lst.add_argument("--reminder", default=None, help="rows of this reminder id")
    lst.add_argument("--destination", default=None, help="rows sent to exactly this destination")
    lst.add_argument("--channel", default=None, help="webhook, email or sms")
    lst.add_argument("--since", default=None, help="due at or after (ISO 8601 with offset)")
    lst.add_argument("--until", default=None, help="due before (ISO 8601 with offset)")
    lst.add_argument("--limit", type=int, default=50, help="rows per page (default 50)")
    lst.add_argument("--before", type=int, default=None, help="the page before this id")
    add_json(lst)


def _run_action(
    rsub: argparse._SubParsersAction,  # type: ignore[type-arg]
    command: Command,
    name: str,
    summary: str,
) -> None:
    parser = command(
        rsub,
        name,
        summary + "; a dry run unless --apply",
        f"relay runs {name} 42 --reason 'partner outage' --apply",
    )
    parser.add_argument("run", type=int, help="the publish run's id")
    parser.add_argument("--reason", default=None, help="why (recorded)")
    parser.add_argument("--apply", action="store_true", help="do it (default: dry run)")
    if name in ("cancel", "dead-letter"):
        parser.add_argument(
            "--no-wait",
            action="store_true",
            help="return at once instead of waiting (up to RELAY_HTTP_TIMEOUT_SECONDS + 5 s) "
            "for the outcome of the requests already on the wire (none is sent again)",
        )
    add_operator(parser)
    add_json(parser)


def _add_runs(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    runs = command(
        sub,
        "runs",
        "list publish runs; hold, release, cancel or dead-letter one",
        "relay runs list",
        "relay runs hold 42 --reason 'clinic portal down' --apply",
    )
    rsub = runs.add_subparsers(dest="action", required=True, metavar="ACTION")
    lst = command(rsub, "list", "recent runs with what became of their rows", "relay runs list")
    lst.add_argument("--limit", type=int, default=20, help="runs per page (default 20)")
    lst.add_argument("--before", type=int, default=None, help="the page before this run id")
    lst.add_argument("--all-runs", action="store_true", help="include runs that admitted nothing")
    add_json(lst)
    _run_action(rsub, command, "hold", "stop sending a run's rows (parked, no attempt)")
    _run_action(rsub, command, "release", "send a held run's rows again")
    _run_action(
        rsub, command, "cancel", "skip a run's rows not final, claimed ones too (cancelled)"
    )
    _run_action(rsub, command, "dead-letter", "make a run's rows not final dead, claimed ones too")


def _add_backfill(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    bf = command(
        sub,
        "backfill",
        "admit a window's occurrences the ledger does not have (or skipped while paused); "
        "a dry run unless --apply",
        "relay backfill --reminder clinic-42-daily --from 2026-03-02T06:00:00+00:00 "
        "--to 2026-03-02T08:00:00+00:00",
        "relay backfill --all --from 2026-03-02T06:00:00+00:00 --apply --publish",
    )
    which = bf.add_mutually_exclusive_group(required=True)
    which.add_argument("--reminder", default=None, help="this reminder id")
    which.add_argument("--all", action="store_true", help="every active reminder")
    bf.add_argument("--from", dest="start", required=True, help="window start (ISO 8601)")
    bf.add_argument("--to", dest="end", default=None, help="window end, inclusive (default: now)")
    bf.add_argument("--apply", action="store_true", help="do it (default: dry run)")
    bf.add_argument(
        "--publish",
        action="store_true",
        help="publish the admitted rows now (default: the next relay publish does)",
    )
    add_json(bf)
