"""Handlers of the ``relay`` subcommands that need only the shared core.

Each handler is ``async (args, settings) -> exit code``; human output goes to stdout,
structured logs to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import BinaryIO

import asyncpg

from service import db, destinations, edits, errors, ledger, netpolicy, runs, schedule
from service.ops import partner as partner_mod
from service.ops import reminders
from service.ops import status as status_mod
from service.settings import Settings


@asynccontextmanager
async def _pool(settings: Settings, *, check_schema: bool = True) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(settings, size=2, check_schema=check_schema)
    try:
        yield pool
    finally:
        await pool.close()


def allow_list(settings: Settings) -> list[netpolicy.IPNetwork]:
    try:
        return netpolicy.parse_networks(settings.allow_networks)
    except ValueError as exc:
        raise errors.ConfigError(f"RELAY_ALLOW_NETWORKS: {exc}") from None


async def migrate(args: argparse.Namespace, settings: Settings) -> int:
    async with _pool(settings, check_schema=False) as pool:
        applied = await db.migrate(pool)
    print(f"migrations applied: {', '.join(applied) if applied else 'none (up to date)'}")
    return errors.ExitCode.OK


async def reminders_load(args: argparse.Namespace, settings: Settings) -> int:
    allow = allow_list(settings)
    try:
        # Bytes, not text: an invalid UTF-8 byte is then reported with its line number.
        source: BinaryIO = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")
    except OSError as exc:
        raise errors.InputError(f"{args.file}: {exc.strerror}") from None
    tally = edits.Tally()  # what the load's schedule changes skipped, for the summary
    try:
        async with _pool(settings) as pool:
            lines = reminders.read_lines(source)
            registration = destinations.Registration.of(
                settings.destinations_registered_only, settings.destination_secrets_keys
            )
            # Streamed, chunk by chunk; unknown webhook destinations registered (or refused).
            count = await reminders.load(pool, lines, allow, registration=registration, tally=tally)
    finally:
        if args.file != "-":
            source.close()
    print(f"loaded {count} reminders{tally.render()}")
    return errors.ExitCode.OK


def _utc(at: datetime | None) -> str:
    return f"{at:%Y-%m-%d %H:%M:%S}" if at else "-"


def _reminder_json(row: asyncpg.Record) -> dict[str, object]:
    """A reminder as ``--json`` prints it: never its destination or payload."""
    fields = ("id", "channel", "schedule_kind", "timezone", "missed_policy", "urgent")
    data: dict[str, object] = {k: row[k] for k in fields if k in row.keys()}
    data.update(schedule=_describe_schedule(row), next_due_at=row["next_due_at"])
    data["active"] = row["active"]
    # why not: cancelled (by an operator), destination_disabled or gone (paused)
    data["inactive_reason"] = row["inactive_reason"]
    return data


def _describe_schedule(row: asyncpg.Record) -> str:
    if row["schedule_kind"] == "daily":
        return f"daily {row['daily_at']:%H:%M} {row['timezone']}"
    if row["schedule_kind"] == "cron":
        return f"cron {row['cron']} {row['timezone']}"
    return f"once {_utc(row['due_at'])}"


def _state(row: asyncpg.Record) -> str:
    """``True``, or why not (``False (cancelled)``, ``False (destination_disabled)``)."""
    return "True" if row["active"] else f"False ({row['inactive_reason']})"


async def reminders_list(args: argparse.Namespace, settings: Settings) -> int:
    async with _pool(settings) as pool:
        rows = await pool.fetch(db.q("list_reminders"), args.after, args.limit)
    if args.json:
        print(status_mod.to_json({"reminders": [_reminder_json(r) for r in rows]}))
        return errors.ExitCode.OK
    print(f"{'id':<28} {'channel':<8} {'schedule':<34} {'next due (UTC)':<20} active")
    for r in rows:
        print(
            f"{r['id']:<28} {r['channel']:<8} {_describe_schedule(r)[:34]:<34} "
            f"{_utc(r['next_due_at']):<20} {_state(r)}"
        )
    return errors.ExitCode.OK


async def reminders_show(args: argparse.Namespace, settings: Settings) -> int:
    async with _pool(settings) as pool:
        row = await pool.fetchrow(db.q("get_reminder"), args.id)
    if row is None:
        print(f"relay: no reminder {args.id!r}", file=sys.stderr)
        return errors.ExitCode.INCOMPLETE
    upcoming = _upcoming(row, args.count)
    if args.json:
        data = _reminder_json(row)
        data.update(
            provider=row["provider"],
            payload_version=row["payload_version"],
            stale_after_seconds=row["stale_after"].total_seconds() if row["stale_after"] else None,
            next_occurrences=upcoming,
        )
        print(status_mod.to_json(data))
        return errors.ExitCode.OK
    for key in (
        "id",
        "channel",
        "schedule_kind",
        "timezone",
        "missed_policy",
        "stale_after",
        "urgent",
        "provider",
        "active",
        "inactive_reason",
        "payload_version",
        "next_due_at",
    ):
        print(f"{key:>16}: {row[key]}")
    print("next occurrences:" if upcoming else "next occurrences: none")
    from zoneinfo import ZoneInfo

    zone = ZoneInfo(row["timezone"])
    for at in upcoming:
        print(
            f"  {at.astimezone(zone):%Y-%m-%d %H:%M %Z} ({row['timezone']})  "
            f"= {at:%Y-%m-%d %H:%M} UTC"
        )
    return errors.ExitCode.OK


def _upcoming(row: asyncpg.Record, count: int) -> list[datetime]:
    if row["next_due_at"] is None or not row["active"]:
        return []
    start = row["next_due_at"]
    return schedule.occurrences(schedule.from_row(row), start, _horizon(start), count)


# How far ahead `reminders show` looks for occurrences: two years. A duration, not
# `replace(year=...)`, which fails for 29 February.
_SHOW_HORIZON = timedelta(days=731)


def _horizon(start: datetime) -> datetime:
    """``start`` plus two years, or the end of the calendar if that is sooner."""
    try:
        return start + _SHOW_HORIZON
    except OverflowError:
        return datetime.max.replace(tzinfo=UTC)


async def reminders_cancel(args: argparse.Namespace, settings: Settings) -> int:
    async with _pool(settings) as pool:
        done = await ledger.cancel_reminder(pool, args.id)
    if not done:
        print(f"relay: no reminder {args.id!r} to cancel (unknown, already cancelled, or erased)",
              file=sys.stderr)  # fmt: skip
        return errors.ExitCode.INCOMPLETE
    print(
        f"cancelled {args.id}: no new occurrences; queued sends will be skipped; "
        "enabling its destination does not bring it back"
    )
    return errors.ExitCode.OK


async def _status_missing(
    args: argparse.Namespace, pool: asyncpg.Pool, receipt_wait_seconds: float
) -> int:
    """``relay status --missing``: who did not get it, of the run (the latest that admitted
    anything, by default), of the outbox intents and, grouped by event, of the events; an
    accepted e-mail or SMS says how long its provider has had it without a receipt."""
    run_id = args.run or await runs.latest_with_work(pool)
    rows = [] if run_id is None else await status_mod.missing(pool, run_id, args.limit)
    purged = 0 if run_id is None else await runs.rows_purged_missing(pool, run_id)
    outbox = await status_mod.outbox_missing(pool, args.limit)
    by_event = await status_mod.event_missing(pool, args.limit)
    if run_id is None and not outbox and not by_event:
        print("relay: no publish runs yet", file=sys.stderr)
        return errors.ExitCode.INCOMPLETE
    found = {
        "run_id": run_id,
        "missing": rows,
        "rows_purged_missing": purged,
        "outbox_missing": outbox,
        "event_missing": by_event,
    }
    print(
        status_mod.to_json(found)
        if args.json
        else status_mod.render_missing(
            run_id, rows, outbox, by_event, receipt_wait_seconds, purged_missing=purged
        )
    )
    return errors.ExitCode.OK


async def status(args: argparse.Namespace, settings: Settings) -> int:
    async with _pool(settings) as pool:
        now = await pool.fetchval(db.q("db_now"))
        if args.missing:
            return await _status_missing(args, pool, settings.receipt_wait_seconds)
        reports = await runs.reports(
            pool,
            args.run,
            args.runs,
            now,
            nonempty=args.run is None and not args.all_runs,
            receipt_wait_seconds=settings.receipt_wait_seconds,
        )
        totals = await status_mod.overall(pool, settings.receipt_wait_seconds)
        actions = await status_mod.actions(pool, [r.run_id for r in reports])
    if args.json:
        print(status_mod.to_json({"runs": status_mod.runs_json(reports, actions), **totals}))
    else:
        print(status_mod.render_table(reports, totals, actions))
    return errors.ExitCode.OK


async def _set_admission(settings: Settings, paused: bool) -> int:
    async with _pool(settings) as pool, pool.acquire() as conn:
        await runs.set_admission_paused(conn, paused, getpass.getuser())
    print(
        "admission paused: publish runs will record and exit; occurrences falling due until "
        "`relay resume` will be skipped (paused), never sent (relay backfill sends them)"
        if paused
        else "admission resumed"
    )
    return errors.ExitCode.OK


async def pause(args: argparse.Namespace, settings: Settings) -> int:
    return await _set_admission(settings, True)


async def resume(args: argparse.Namespace, settings: Settings) -> int:
    return await _set_admission(settings, False)


async def partner(args: argparse.Namespace, settings: Settings) -> int:
    secrets = [s.get_secret_value() for s in settings.webhook_signing_secrets]
    state = partner_mod.Partner(verify_secret=secrets[0] if secrets else None)
    runner, port = await partner_mod.start(state, args.host, args.port)
    print(f"partner listening on http://{args.host}:{port}/hooks/<name>", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
    return errors.ExitCode.OK
