"""The ``relay`` command line: argument parsing and dispatch to each command's handler.

Handlers live beside what they drive (``publisher.commands``, ``consumer.commands``,
``service.ops.commands``) and are looked up by name when their subcommand runs, so
``service`` never imports ``publisher`` or ``consumer`` and a consumer process never
loads the publisher's code.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Coroutine, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeAlias

import uvloop

from service import errors, logs, settings
from service.ops import cli_erase, cli_events, cli_operators, cli_purge, cli_receipts
from service.ops.console import cli_args as console_args

_log = logs.get("cli")
# The folder holding service/, publisher/ and consumer/: frames there are this project's.
_PROJECT_ROOT = Path(__file__).resolve().parents[2]

Handler = Callable[[argparse.Namespace, settings.Settings], Coroutine[Any, Any, int]]

# subcommand -> "module:function"; the function is async (args, settings) -> exit code.
HANDLERS = {
    "migrate": "service.ops.commands:migrate",
    "reminders.load": "service.ops.commands:reminders_load",
    "reminders.list": "service.ops.commands:reminders_list",
    "reminders.show": "service.ops.commands:reminders_show",
    "reminders.cancel": "service.ops.commands:reminders_cancel",
    "status": "service.ops.commands:status",
    "pause": "service.ops.commands:pause",
    "resume": "service.ops.commands:resume",
    "partner": "service.ops.commands:partner",
    "destinations.add": "service.ops.destinations:add",
    "destinations.show": "service.ops.destinations:show",
    "destinations.list": "service.ops.destinations:list_",
    "destinations.rotate-secret": "service.ops.destinations:rotate_secret",
    "destinations.disable": "service.ops.destinations:disable",
    "destinations.enable": "service.ops.destinations:enable",
    "destinations.envelope": "service.ops.destinations:envelope",
    "destinations.rekey": "service.ops.destinations:rekey",
    "demo": "service.ops.demo:main",
    "publish": "publisher.commands:publish",
    "rescue": "publisher.commands:rescue",
    "replay": "publisher.commands:replay",
    "consume": "consumer.commands:consume",
    **cli_operators.HANDLERS,
    **cli_receipts.HANDLERS,
    **cli_events.HANDLERS,
    **cli_erase.HANDLERS,
    **console_args.HANDLERS,
    **cli_purge.HANDLERS,
}


# The subcommands' parsers (argparse's type for it is private).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

_SETTINGS_NOTE = "Settings come from RELAY_* environment variables (see the README)."


def _version() -> str:
    try:
        return f"relay {metadata.version('reminder-relay')}"
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "relay (version unknown: not installed)"


def _command(sub: Subcommands, name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose help has a one-line description and examples."""
    lines = "\n".join(f"  {example}" for example in examples)
    return sub.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog=f"example{'s' if len(examples) > 1 else ''}:\n{lines}\n\n{_SETTINGS_NOTE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``relay`` parser; ``relay --help`` lists the subcommands in this order."""
    parser = argparse.ArgumentParser(
        prog="relay",
        description="Deliver scheduled reminders: one logical event per delivery, none lost.",
        epilog="exit codes: 0 ok, 1 incomplete (rows left for the next run), "
        "2 bad setting, argument or input (nothing done), 3 database or broker unavailable, "
        "4 refused while deliveries are in flight (erase; nothing done), "
        "70 a bug (an unexpected exception; the message says so). " + _SETTINGS_NOTE,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(sub, "migrate", "apply database migrations (idempotent)", "relay migrate")
    _add_reminders(sub)
    _add_publish_and_rescue(sub)
    _add_replay(sub)
    _add_consume(sub)
    _add_status(sub)
    _add_destinations(sub)
    cli_events.add(sub, _command)
    cli_operators.add(sub, _command)
    _command(sub, "pause", "pause admission: publish runs record and exit", "relay pause")
    _command(sub, "resume", "resume admission", "relay resume")
    _add_partner_and_demo(sub)
    console_args.add(sub, _command)
    cli_receipts.add(sub, _command)
    cli_erase.add(sub, _command)
    cli_purge.add(sub, _command)
    return parser


def _add_reminders(sub: Subcommands) -> None:
    rem = _command(
        sub,
        "reminders",
        "load, list, show or cancel reminders",
        "relay reminders load reminders.jsonl",
        "relay reminders show clinic-42-daily",
    )
    rsub = rem.add_subparsers(dest="action", required=True, metavar="ACTION")
    load = _command(
        rsub,
        "load",
        "upsert reminders from a JSON Lines file, all or nothing",
        "relay reminders load reminders.jsonl",
        "cat reminders.jsonl | relay reminders load -",
    )
    load.add_argument("file", help="JSON Lines file, one reminder per line (- reads stdin)")
    lst = _command(rsub, "list", "list reminders, by id", "relay reminders list --limit 20")
    lst.add_argument("--limit", type=int, default=50, help="most reminders to list (default 50)")
    lst.add_argument("--after", default=None, help="page after this id")
    cli_operators.add_json(lst)
    show = _command(
        rsub,
        "show",
        "a reminder and its next occurrences (local time and UTC)",
        "relay reminders show clinic-42-daily --next 10",
    )
    show.add_argument("id", help="the reminder's id")
    show.add_argument(
        "--next", type=int, default=5, dest="count", help="how many occurrences (default 5)"
    )
    cli_operators.add_json(show)
    cancel = _command(
        rsub,
        "cancel",
        "deactivate a reminder (queued sends are skipped)",
        "relay reminders cancel clinic-42-daily",
    )
    cancel.add_argument("id", help="the reminder's id")


def _add_publish_and_rescue(sub: Subcommands) -> None:
    pub = _command(
        sub,
        "publish",
        "one discovery run (CronJob): admission, the pending sweep, then rescue",
        "relay publish",
        "relay publish --scheduled-at 2026-03-01T06:00:00+00:00",
    )
    pub.add_argument(
        "--scheduled-at",
        default=None,
        help=(
            "intended fire time (ISO 8601) for scheduler-lag accounting; default: the oldest"
            " due reminder's time when one is overdue, else now"
        ),
    )
    _command(sub, "rescue", "republish rows whose message was lost", "relay rescue")


def _add_replay(sub: Subcommands) -> None:
    rep = _command(
        sub,
        "replay",
        "replay dead letters (from the queue or the ledger); a dry run unless --apply",
        "relay replay",
        "relay replay --from ledger --since 2026-03-01T00:00:00+00:00 --channel sms --apply",
    )
    rep.add_argument(
        "--from",
        dest="source",
        choices=["queue", "ledger"],
        default="queue",
        help="read the dead-letter queue (default) or select rows from the ledger",
    )
    rep.add_argument("--apply", action="store_true", help="do it (default: dry run)")
    rep.add_argument("--dry-run", action="store_true", help="print what would happen (default)")
    rep.add_argument(
        "--limit", type=int, default=1000, help="most deliveries to replay (default 1000)"
    )
    # Which ledger rows to replay (with --from ledger).
    rep.add_argument(
        "--state",
        action="append",
        default=None,
        help="ledger states to select (default: dead); repeatable",
    )
    rep.add_argument("--since", default=None, help="created at or after (ISO 8601 with offset)")
    rep.add_argument("--until", default=None, help="created before (ISO 8601 with offset)")
    rep.add_argument("--run", type=int, default=None, help="only deliveries of this publish run")
    rep.add_argument("--reminder", default=None, help="only deliveries of this reminder id")
    rep.add_argument("--provider", default=None, help="only deliveries for this provider")
    rep.add_argument("--channel", default=None, help="only this channel (webhook, email, sms)")
    rep.add_argument("--key", default=None, help="only the delivery with this idempotency key")
    rep.add_argument(
        "--last-status", type=int, default=None, help="only rows whose last HTTP status was this"
    )
    rep.add_argument(
        "--operator",
        default=os.environ.get("USER", "unknown"),
        help="who replays, recorded with an applied replay (default: $USER)",
    )
    rep.add_argument(
        "--drop",
        action="store_true",
        help="with --from queue: drop (acknowledge, never replay) the dead letters that are "
        "undecodable, name no delivery, or match the filters",
    )
    cli_operators.add_json(rep)


def _add_consume(sub: Subcommands) -> None:
    con = _command(
        sub,
        "consume",
        "consume and deliver until SIGTERM (Deployment)",
        "relay consume",
        "relay consume --check",
    )
    con.add_argument(
        "--check",
        action="store_true",
        help="probe: check the settings as consume does, then that the database (with its "
        "schema) and the broker answer; exit 0 if so",
    )


def _add_status(sub: Subcommands) -> None:
    st = _command(
        sub,
        "status",
        "per-run report: who got it and who did not",
        "relay status",
        "relay status --missing --json",
    )
    st.add_argument("--run", type=int, default=None, help="report this publish run only")
    st.add_argument("--runs", type=int, default=10, help="how many recent runs (default 10)")
    st.add_argument(
        "--all-runs",
        action="store_true",
        help="include runs that admitted nothing (by default only runs with work)",
    )
    st.add_argument("--missing", action="store_true", help="list deliveries not delivered")
    st.add_argument(
        "--limit", type=int, default=1000, help="most rows --missing lists (default 1000)"
    )
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_destinations(sub: Subcommands) -> None:
    from service.ops import destinations

    destinations.add_parser(sub, _command)


def _add_partner_and_demo(sub: Subcommands) -> None:
    par = _command(
        sub,
        "partner",
        "run the demo partner endpoint (honours keys)",
        "relay partner --port 8090",
    )
    par.add_argument("--host", default="127.0.0.1", help="address to listen on")
    par.add_argument("--port", type=int, default=8090, help="port to listen on (default 8090)")
    demo = _command(
        sub,
        "demo",
        "the whole pipeline on this machine, then a report",
        "relay demo --reminders 1000 --consumers 2",
    )
    demo.add_argument(
        "--reminders", type=int, default=1000, help="reminders to load (default 1000)"
    )
    demo.add_argument(
        "--consumers", type=int, default=2, help="consumer processes to start (default 2)"
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="leave the run's own database and broker namespace in place (removed by default)",
    )


def resolve(name: str) -> Handler:
    module_name, _, func = HANDLERS[name].partition(":")
    handler: Handler = getattr(importlib.import_module(module_name), func)
    return handler


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``relay`` console script.

    Every failure it expects ends in one line on stderr and a documented exit code: a bad
    setting, argument or input (2), a server that cannot be used (3). Anything else is a
    bug: one line saying so and where, and the traceback as a DEBUG log line
    (``RELAY_LOG_LEVEL=DEBUG`` shows it); exit 1.
    """
    args = build_parser().parse_args(argv)
    level = os.environ.get("RELAY_LOG_LEVEL", "INFO").upper()
    if level not in _LOG_LEVELS:
        print(
            f"relay: configuration error: RELAY_LOG_LEVEL: must be one of {', '.join(_LOG_LEVELS)}",
            file=sys.stderr,
        )
        return errors.ExitCode.CONFIG
    logs.setup(level)
    try:
        config = settings.load()
    except errors.ConfigError as exc:
        print(f"relay: configuration error: {exc}", file=sys.stderr)
        return errors.ExitCode.CONFIG
    name = args.command + (f".{args.action}" if getattr(args, "action", None) else "")
    try:
        handler = resolve(name)  # imports the command's modules
        # A message allocates hundreds of short-lived objects, so the default cyclic-GC
        # threshold (700) collected every few messages: 1,340 collections, 8 % of the
        # consumer's CPU over 20,000 deliveries. What start-up loaded is frozen out of the
        # scans and young collections run less often: ~150 collections, under 1 %.
        gc.freeze()
        gc.set_threshold(10_000, 20, 20)
        # uvloop: a faster event loop for every command (a third less CPU per message).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(handler(args, config))
    except errors.ConfigError as exc:
        print(f"relay: configuration error: {exc}", file=sys.stderr)
        return errors.ExitCode.CONFIG
    except errors.InputError as exc:
        for line in str(exc).splitlines():
            print(f"relay: bad input: {line}", file=sys.stderr)
        return errors.ExitCode.CONFIG
    except errors.UnavailableError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return errors.ExitCode.UNAVAILABLE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: say so in one line, keep the traceback for DEBUG
        return _internal_error(exc)


def _internal_error(exc: Exception) -> int:
    """Report a bug: one line on stderr naming the error and where it was raised, and the
    traceback as a DEBUG log line. The message is redacted (no addresses) and cut short."""
    where = _bug_site(exc)
    detail = " ".join(logs.redact(str(exc)).split())[:200]
    _log.debug("internal error", exc_info=exc, extra={"event": "internal_error", "where": where})
    print(
        f"relay: internal error (a bug): {type(exc).__name__}"
        + (f": {detail}" if detail else "")
        + f" at {where}; RELAY_LOG_LEVEL=DEBUG prints the traceback",
        file=sys.stderr,
    )
    return errors.ExitCode.BUG


def _bug_site(exc: BaseException) -> str:
    """``path:line`` of the innermost frame in this project's code (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    root = _PROJECT_ROOT
    ours = [f for f in frames if Path(f.filename).is_relative_to(root)]
    frame = (ours or frames)[-1]
    path = Path(frame.filename)
    shown = path.relative_to(root) if path.is_relative_to(root) else Path(path.name)
    return f"{shown}:{frame.lineno}"


if __name__ == "__main__":
    sys.exit(main())
