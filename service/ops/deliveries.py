"""``relay deliveries show`` and ``relay deliveries list``: one delivery's story, and the
deliveries an operator filters for.

``show`` prints the row, its reminder (schedule, policy, state) or that it is an outbox
intent, its run, and every attempt: start, duration, outcome, HTTP status or error
class, and the provider's reply excerpt, bounded and redacted. Recipients, payloads and
secrets are never printed: a webhook destination is shown as its scheme and host, an
e-mail address or phone number not at all (``service.ops.redaction``, which the console
shares).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg

from service import db, entry, errors, events, receipts, reconciliations, retention
from service.ledger import State
from service.ops import redaction
from service.settings import Settings


@asynccontextmanager
async def open_pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(settings, size=2)
    try:
        yield pool
    finally:
        await pool.close()


def to_json(data: Any) -> str:
    """One JSON document: sorted keys, times in ISO 8601."""
    return json.dumps(data, default=_default, indent=2, sort_keys=True)


def _default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _schedule(row: asyncpg.Record) -> str | None:
    kind = row["schedule_kind"]
    if kind is None:
        return None
    if kind == "daily":
        return f"daily {row['daily_at']:%H:%M} {row['timezone']}"
    if kind == "cron":
        return f"cron {row['cron']} {row['timezone']}"
    return f"once {row['due_at']:%Y-%m-%d %H:%M:%S}Z"


_ROW_FIELDS = (
    "id idempotency_key source channel provider state occurrence_at urgent attempts replays "
    "next_attempt_at last_status last_error receipt skip_reason run_id created_at "
    "published_at first_attempt_at finished_at dead_lettered_at settled_at rescued_at "
    "republished_at republishes content_purged_at erased_at"
).split()


def story(
    row: asyncpg.Record,
    attempts: list[asyncpg.Record],
    receipts_of: list[dict[str, Any]],
    reconciled: list[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON document of ``deliveries show`` (stable field names, documented)."""
    data: dict[str, Any] = {name: row[name] for name in _ROW_FIELDS}
    data["last_error"] = redaction.text(row["last_error"])
    data["receipt"] = redaction.text(row["receipt"])
    data["destination"] = redaction.destination(row["channel"], row["destination"])
    data["intent"] = None
    data["event"] = None  # filled by show() for an event's delivery
    if row["source"] == "outbox":
        data["intent"] = {"source": "outbox", "key": row["idempotency_key"]}
        data["reminder"] = None
    else:
        data["reminder"] = {
            "id": row["reminder_id"],
            "schedule": _schedule(row),
            "missed_policy": row["missed_policy"],
            "active": row["reminder_active"],
            "next_due_at": row["reminder_next_due_at"],
        }
    data["run"] = (
        None
        if row["run_id"] is None
        else {
            "id": row["run_id"],
            "kind": row["run_kind"],
            "status": row["run_status"],
            "held": row["run_held_at"] is not None,
        }
    )
    data["attempt_history"] = [
        {
            "attempt": a["attempt"],
            "started_at": a["started_at"],
            "finished_at": a["finished_at"],
            "duration_ms": None if a["latency_ms"] is None else round(a["latency_ms"], 1),
            "outcome": a["outcome"],
            "http_status": a["http_status"],
            "error": redaction.text(a["error"]),
            "reply_excerpt": redaction.text(a["response_excerpt"]),
            "possibly_delivered": a["possibly_delivered"],
            "stale": a["stale"],
            "provider_message_id": a["provider_message_id"],
        }
        for a in attempts
    ]
    data["receipts"] = [{**r, "reason": redaction.text(r["reason"])} for r in receipts_of]
    data["reconciliations"] = [{**r, "error": redaction.text(r["error"])} for r in reconciled]
    return data


def _t(value: datetime | None) -> str:
    return "-" if value is None else f"{value:%Y-%m-%d %H:%M:%S}"


def render_story(data: dict[str, Any]) -> str:
    lines = [f"delivery {data['id']}  {data['idempotency_key']}"]
    for key in ("state", "skip_reason", "channel", "provider", "destination", "occurrence_at"):
        value = data[key]
        if value is not None:
            lines.append(f"  {key:<16} {_t(value) if isinstance(value, datetime) else value}")
    lines.append(f"  {'attempts':<16} {data['attempts']} (replays {data['replays']})")
    for key in ("last_status", "last_error", "next_attempt_at", "receipt"):
        if data[key] is not None:
            value = data[key]
            lines.append(f"  {key:<16} {_t(value) if isinstance(value, datetime) else value}")
    created, finished = _t(data["created_at"]), _t(data["finished_at"])
    lines.append(f"  {'created/final':<16} {created} / {finished}")
    lines.extend(_removed_lines(data))
    if data["reminder"] is not None:
        r = data["reminder"]
        active = "active" if r["active"] else "inactive or gone"
        lines.append(
            f"  reminder         {r['id']}: {r['schedule'] or '-'}, "
            f"missed_policy {r['missed_policy'] or '-'}, {active}"
        )
    elif data.get("event") is not None:
        e = data["event"]
        lines.append(
            f"  event            {e['id']} {e['event_type']} {e['key']} "
            f"({_t(e['created_at'])}; {e['deliveries']} deliveries, one per subscribed "
            "destination)"
        )
    else:
        lines.append("  intent           outbox (committed by an application)")
    if data["run"] is not None:
        run = data["run"]
        held = ", HELD" if run["held"] else ""
        lines.append(f"  run              {run['id']} ({run['kind']}, {run['status']}{held})")
    history = data["attempt_history"]
    lines.append(f"attempts ({len(history)}):" if history else "attempts: none")
    for a in history:
        answer = a["http_status"] if a["http_status"] is not None else (a["error"] or "-")
        took = "-" if a["duration_ms"] is None else f"{a['duration_ms']:.0f} ms"
        lines.append(
            f"  #{a['attempt']:<3} {_t(a['started_at'] or a['finished_at'])}  {took:>8}  "
            f"{a['outcome']:<9} {answer}"
        )
        if a["reply_excerpt"]:
            lines.append(f"        reply: {a['reply_excerpt']}")
        elif data["content_purged_at"] is not None and a["http_status"] is not None:
            lines.append("        reply: (purged)")
        if a["error"] and a["http_status"] is not None:
            lines.append(f"        error: {a['error']}")
        if a["provider_message_id"]:
            lines.append(f"        provider message: {a['provider_message_id']}")
    lines.extend(_receipt_lines(data["receipts"]))
    lines.extend(_reconciliation_lines(data["reconciliations"]))
    return "\n".join(lines)


def _removed_lines(data: dict[str, Any]) -> list[str]:
    """What retention purged and an erasure redacted of the row, and when."""
    lines = []
    if data["content_purged_at"] is not None:
        lines.append(
            f"  {'content':<16} purged {_t(data['content_purged_at'])} (retention): payload, "
            "recipient and replies are gone; ids, state, times, counts and reasons stay"
        )
    if data["erased_at"] is not None:
        lines.append(
            f"  {'erased':<16} {_t(data['erased_at'])} (relay erase): recipient, payload, "
            "replies and receipt are gone; ids, state, times and counts stay"
        )
    return lines


def _receipt_lines(found: list[dict[str, Any]]) -> list[str]:
    """The provider's receipts, as they came (e-mail and SMS; none for a webhook)."""
    if not found:
        return []
    lines = [f"receipts ({len(found)}):"]
    for r in found:
        why = f" {r['reason']}" if r["reason"] else ""
        hard = " (permanent)" if r["permanent"] else ""
        lines.append(
            f"  {_t(r['received_at'])}  {r['outcome']:<10} {r['event']}{why}{hard}"
            f"  message {r['provider_message_id']}"
        )
    return lines


_POLICIES = {
    "no_resend": "not sent again",
    "resend": "sent again",
    "resend_same_key": "sent again with the same key (policy for e-mail when the provider "
    "cannot say: it answers a repeated key with the first message)",
    "hold": "held, to ask again (policy for SMS when the provider cannot say: never a second text)",
}


def _reconciliation_lines(found: list[dict[str, Any]]) -> list[str]:
    """Each time the provider was asked before a resend, what it said and what followed."""
    if not found:
        return []
    lines = [f"reconciliations ({len(found)}):"]
    for r in found:
        about = ", ".join(f"#{a}" for a in r["checked_attempts"])
        said = r["answer"].replace("_", " ")
        if r["provider_message_id"]:
            said += f" (message {r['provider_message_id']}, {r['provider_status'] or '-'})"
        if r["error"]:
            said += f" ({r['error']})"
        lines.append(
            f"  {_t(r['asked_at'])}  attempt #{r['attempt']} asked about {about}: {said}; "
            f"{_POLICIES.get(r['policy'], r['policy'])}"
        )
    return lines


async def show(args: argparse.Namespace, settings: Settings) -> int:
    if (args.id is None) == (args.key is None):
        raise errors.ConfigError("deliveries show: give an ID or --key KEY (one of them)")
    async with open_pool(settings) as pool:
        row = await pool.fetchrow(db.q("delivery_show"), args.id, args.key)
        if row is None:
            what = f"id {args.id}" if args.id is not None else f"key {args.key!r}"
            reached = (await retention.horizon(pool)).rows_purged_before
            purged = (
                ""
                if reached is None
                else f" (rows of deliveries that ended before {reached:%Y-%m-%d %H:%M} UTC "
                "were purged by retention)"
            )
            print(f"relay: no delivery with {what}{purged}", file=sys.stderr)
            return errors.ExitCode.INCOMPLETE
        attempts = list(await pool.fetch(db.q("delivery_attempts_of"), row["id"]))
        found = await receipts.of_delivery(pool, row["id"])
        reconciled = await reconciliations.of_delivery(pool, row["id"])
        event = None if row["event_id"] is None else await events.get(pool, row["event_id"])
    data = story(row, attempts, found, reconciled)
    data["event"] = event
    print(to_json(data) if args.json else render_story(data))
    return errors.ExitCode.OK


def _states(names: list[str] | None) -> list[str] | None:
    if not names:
        return None
    valid = {s.value for s in State}
    bad = [n for n in names if n not in valid]
    if bad:
        raise errors.ConfigError(
            f"--state: unknown {', '.join(bad)} (choose from {', '.join(s.value for s in State)})"
        )
    return names


async def list_(args: argparse.Namespace, settings: Settings) -> int:
    if args.limit < 1:
        raise errors.ConfigError("--limit: must be at least 1")
    params = (
        _states(args.state),
        args.run,
        args.reminder,
        args.destination,
        args.channel,
        entry.option_time(args.since, "--since"),
        entry.option_time(args.until, "--until"),
        args.limit + 1,  # one more tells whether another page follows
        args.before,
    )
    async with open_pool(settings) as pool:
        rows = [dict(r) for r in await pool.fetch(db.q("deliveries_list"), *params)]
    more = len(rows) > args.limit
    rows = rows[: args.limit]
    for r in rows:
        r["last_error"] = redaction.text(r["last_error"])
    next_before = rows[-1]["id"] if more else None
    if args.json:
        print(to_json({"deliveries": rows, "next_before": next_before}))
        return errors.ExitCode.OK
    print(render_list(rows, next_before))
    return errors.ExitCode.OK


def render_list(rows: list[dict[str, Any]], next_before: int | None) -> str:
    if not rows:
        return "no deliveries match"
    header = (
        f"{'id':>8} {'state':<9} {'channel':<8} {'run':>5} {'reminder / key':<34} "
        f"{'due (UTC)':<19} {'att':>3} {'last':>4}  reason"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        who = r["reminder_id"] or r["idempotency_key"]
        why = r["skip_reason"] or r["last_error"] or ""
        if r["content_purged_at"] is not None:
            why = f"{why} (content purged)".lstrip()
        lines.append(
            f"{r['id']:>8} {r['state']:<9} {r['channel']:<8} {r['run_id'] or '-':>5} "
            f"{who[:34]:<34} {_t(r['occurrence_at']):<19} {r['attempts']:>3} "
            f"{r['last_status'] or '-':>4}  {why[:60]}"
        )
    if next_before is not None:
        lines.append(f"more: add --before {next_before} for the next page")
    return "\n".join(lines)
