"""``relay status``: the run report, from the ledger alone.

Per run: intended fire time, scheduler lag, what was due, delivered, retrying, dead,
skipped (by reason), the completion ratio and the oldest pending age; and, with
``--missing``, who did not get it. The per-run data comes from ``service.runs``; this
module adds the operator-facing totals and renders text or JSON.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg

from service import db, events, ledger, receipts, runs
from service.ledger import control
from service.ops import redaction


async def overall(pool: asyncpg.Pool, receipt_wait_seconds: float = 900.0) -> dict[str, Any]:
    counts = {r["state"]: r["n"] for r in await pool.fetch(db.q("overall_state_counts"))}
    oldest = await pool.fetchval(db.q("oldest_claimable_age"))
    admission = await pool.fetchrow(db.q("admission_state"))
    assert admission is not None
    return {
        "states": counts,
        "oldest_claimable_seconds": oldest,
        "outbox": await _outbox(pool, events=False),
        "event_deliveries": await _outbox(pool, events=True),
        "admission": dict(admission),
        "no_receipt": await receipts.overdue_total(pool, receipt_wait_seconds),
        "receipt_wait_seconds": receipt_wait_seconds,
    }


async def _outbox(pool: asyncpg.Pool, *, events: bool) -> dict[str, Any]:
    """Outbox deliveries by state: single intents, or (``events``) events' deliveries."""
    rows = await pool.fetch(db.q("outbox_state_counts"), events)
    return {
        "states": {r["state"]: r["n"] for r in rows},
        "oldest_pending_seconds": max(
            (r["oldest_pending_seconds"] for r in rows if r["oldest_pending_seconds"]),
            default=None,
        ),
    }


async def missing(pool: asyncpg.Pool, run_id: int, limit: int) -> list[dict[str, Any]]:
    rows = await pool.fetch(db.q("run_missing"), run_id, limit)
    return [dict(r) for r in rows]


async def outbox_missing(pool: asyncpg.Pool, limit: int) -> list[dict[str, Any]]:
    """Outbox intents not delivered: they belong to no run, and are owed all the same."""
    rows = await pool.fetch(db.q("outbox_missing"), limit)
    return [dict(r) for r in rows]


async def event_missing(pool: asyncpg.Pool, limit: int) -> list[dict[str, Any]]:
    """Events whose deliveries were not all delivered, newest first, grouped by event; a
    destination and its last error redacted as ``deliveries show`` shows them
    (``service.ops.redaction``)."""
    groups = await events.missing(pool, limit)
    for group in groups:
        for row in group["missing"]:
            row["destination"] = redaction.destination(row["channel"], row["destination"])
            row["last_error"] = redaction.text(row["last_error"])
    return groups


async def actions(pool: asyncpg.Pool, run_ids: list[int]) -> list[control.RunAction]:
    return await control.actions_of(pool, run_ids)


def runs_json(
    reports: list[runs.RunReport], recorded: list[control.RunAction]
) -> list[dict[str, Any]]:
    result = []
    for r in reports:
        data = r.as_dict()
        data["actions"] = [a.__dict__ for a in recorded if a.run_id == r.run_id]
        result.append(data)
    return result


# The table's "pending" column: rows not yet worked to an outcome or a retry.
_OPEN = (ledger.State.PENDING, ledger.State.QUEUED, ledger.State.SENDING)


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render_table(
    reports: list[runs.RunReport],
    totals: dict[str, Any],
    recorded: list[control.RunAction] | None = None,
) -> str:
    """A readable report for people."""
    header = (
        f"{'run':>5} {'status':<11} {'intended (UTC)':<17} {'lag s':>7} {'due':>6} "
        f"{'delivered':>9} {'retrying':>8} {'dead':>5} {'skipped':>7} {'pending':>7} "
        f"{'complete':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        lines.extend(_run_lines(r, recorded or [], totals.get("receipt_wait_seconds", 900.0)))
    states = totals["states"]
    summary = ", ".join(f"{k}={states[k]}" for k in sorted(states)) or "no deliveries"
    lines.append("")
    lines.append(f"all deliveries: {summary}")
    for what, key in (("outbox intents", "outbox"), ("event deliveries", "event_deliveries")):
        outbox = totals[key]
        if outbox["states"]:
            parts = ", ".join(f"{k}={v}" for k, v in sorted(outbox["states"].items()))
            pending_age = outbox["oldest_pending_seconds"]
            age = f"; oldest pending {pending_age:.0f} s" if pending_age is not None else ""
            lines.append(f"{what} (no run): {parts}{age}")
    if states.get(ledger.State.ACCEPTED):
        lines.append(
            f"accepted by a provider, no receipt yet: {states[ledger.State.ACCEPTED]} "
            f"({totals['no_receipt']} after {_minutes(totals['receipt_wait_seconds'])})"
        )
    oldest = totals["oldest_claimable_seconds"]
    lines.append(
        "oldest claimable delivery: " + ("none" if oldest is None else f"{oldest:.0f} s old")
    )
    admission = totals["admission"]
    if admission["paused"]:
        lines.append(
            f"admission PAUSED since {admission['changed_at']:%Y-%m-%d %H:%M:%S} "
            f"by {admission['changed_by']}: occurrences due meanwhile are skipped (paused)"
        )
    return "\n".join(lines)


def _run_lines(
    r: runs.RunReport, recorded: list[control.RunAction], receipt_wait_seconds: float
) -> list[str]:
    """One run's row of the table and the lines below it."""
    lines = []
    open_ = sum(r.states.get(s, 0) for s in _OPEN)
    retrying = r.states.get(ledger.State.RETRYING, 0)
    dead = r.states.get(ledger.State.DEAD, 0)
    skipped = r.states.get(ledger.State.SKIPPED, 0)
    lines.append(
        f"{r.run_id:>5} {r.status:<11} {r.intended_fire_at:%Y-%m-%d %H:%M}  "
        f"{r.lag_seconds:>7.1f} {r.due:>6} {r.delivered:>9} "
        f"{retrying:>8} {dead:>5} "
        f"{skipped:>7} {open_:>7} {_fmt_ratio(r.completion_ratio):>8}"
    )
    if r.kind != "publish":
        lines.append(f"{'':>5} a {r.kind} run")
    if r.skipped_by_reason:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(r.skipped_by_reason.items()))
        lines.append(f"{'':>5} skipped by reason: {reasons}")
    if r.oldest_pending_seconds is not None:
        lines.append(f"{'':>5} oldest pending: {r.oldest_pending_seconds:.0f} s")
    if r.held_at is not None:
        lines.append(f"{'':>5} HELD since {r.held_at:%Y-%m-%d %H:%M:%S}")
    lines.extend(_channel_lines(r, receipt_wait_seconds))
    lines.extend(_retention_lines(r))
    for a in recorded:
        if a.run_id == r.run_id:
            lines.append(
                f"{'':>5} {a.at:%Y-%m-%d %H:%M:%S} {a.action} by {a.operator}: "
                f"{a.rows} rows" + (f" ({a.reason})" if a.reason else "") + _reached(a)
            )
    if r.lateness_max_seconds is not None:
        lines.append(
            f"{'':>5} lateness (due -> accepted): p50 {r.lateness_p50_seconds:.2f} s, "
            f"p95 {r.lateness_p95_seconds:.2f} s, max {r.lateness_max_seconds:.2f} s"
        )
    return lines


def _retention_lines(r: runs.RunReport) -> list[str]:
    """What retention took from the run: said, never hidden in the counts."""
    lines = []
    if r.content_purged:
        lines.append(
            f"{'':>5} content purged (retention): {r.content_purged} rows keep their ids, "
            "states, times, counts and reasons; payloads, recipients and replies are gone"
        )
    if r.rows_purged:
        lines.append(
            f"{'':>5} rows purged (retention): {r.rows_purged} ({r.rows_purged_missing} not "
            "delivered), counted above from the run's record; no longer listed"
        )
    return lines


def _reached(a: control.RunAction) -> str:
    """What a cancel or dead-letter met besides the rows it moved."""
    if not a.claimed_stopped and not a.on_the_wire:
        return ""
    text = f"; {a.claimed_stopped} claimed, stopped before their request"
    if a.on_the_wire:
        text += f"; {a.on_the_wire} on the wire"
        if a.wire_outcomes:
            text += ": " + ", ".join(f"{n} {s}" for s, n in sorted(a.wire_outcomes.items()))
    return text


def _channel_lines(r: runs.RunReport, receipt_wait_seconds: float) -> list[str]:
    """Per channel: delivered / owed, with skipped, dead and pending beside it; for e-mail
    and SMS also accepted (no receipt yet; how many past the wait) and bounced."""
    lines = []
    for channel, states in sorted(r.channels.items()):
        s = runs.summary(states, r.no_receipt.get(channel, 0), channel)
        receipt = (
            f", accepted {s['accepted']} (no receipt after "
            f"{_minutes(receipt_wait_seconds)}: {s['no_receipt']}), bounced {s['bounced']}"
            if "accepted" in s
            else ""
        )
        lines.append(
            f"{'':>5} {channel}: delivered {s['delivered']}/{s['owed']} "
            f"({_fmt_ratio(s['completion_ratio'])}){receipt}, skipped {s['skipped']}, "
            f"dead {s['dead']}, pending {s['pending']}"
        )
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def render_missing(
    run_id: int | None,
    rows: list[dict[str, Any]],
    outbox: list[dict[str, Any]] | None = None,
    by_event: list[dict[str, Any]] | None = None,
    receipt_wait_seconds: float = 900.0,
    purged_missing: int = 0,
) -> str:
    text = (
        "no publish run has admitted anything yet"
        if run_id is None
        else _render_missing_rows(f"run {run_id}", rows, receipt_wait_seconds)
    )
    if purged_missing:
        text += (
            f"\nrun {run_id}: {purged_missing} more not delivered whose rows were purged "
            "(retention): counted by relay status --run, no longer listed"
        )
    text += "\n" + _render_missing_rows(
        "outbox intents (no run)", outbox or [], receipt_wait_seconds
    )
    if by_event:  # said only when some event's delivery is missing
        text += "\n" + _render_event_missing(by_event, receipt_wait_seconds)
    return text


def _render_event_missing(groups: list[dict[str, Any]], wait_seconds: float) -> str:
    """Events whose deliveries were not all delivered: per event, who did not get it."""
    lines = [f"events (no run): {len(groups)} with deliveries not delivered"]
    for g in groups:
        lines.append(
            f"event {g['event_id']} {g['event_type']} {g['key']} "
            f"({g['created_at']:%Y-%m-%d %H:%M:%S}): {len(g['missing'])} not delivered"
        )
        for r in g["missing"]:
            lines.append(
                f"  {r['id']:>9} {r['destination'] or '-':<32} {r['state']:<9} "
                f"{r['last_status'] or '-':>5} {r['attempts']:>3}  {_why_missing(r, wait_seconds)}"
            )
    return "\n".join(lines)


def _render_missing_rows(what: str, rows: list[dict[str, Any]], wait_seconds: float) -> str:
    if not rows:
        return f"{what}: every delivery was delivered"
    header = (
        f"{'delivery':>9} {'reminder':<24} {'channel':<8} {'state':<9} {'last':>5} "
        f"{'attempts':>8}  next attempt / reason"
    )
    lines = [f"{what}: {len(rows)} not delivered", header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['id']:>9} {str(r['reminder_id'] or r.get('idempotency_key'))[:24]:<24} "
            f"{r['channel']:<8} "
            f"{r['state']:<9} {r['last_status'] or '-':>5} {r['attempts']:>8}  "
            f"{_why_missing(r, wait_seconds)}"
        )
    return "\n".join(lines)


def _why_missing(r: dict[str, Any], wait_seconds: float) -> str:
    """The next attempt, the skip reason or last error; for an accepted row, how long the
    provider has had it without a receipt."""
    purged = " (content purged)" if r.get("content_purged_at") is not None else ""
    if r["next_attempt_at"]:
        return f"{r['next_attempt_at']:%Y-%m-%d %H:%M:%S}"
    waited = r.get("accepted_seconds")
    if r["state"] == ledger.State.ACCEPTED and waited is not None:
        if waited >= wait_seconds:
            return f"accepted, no receipt after {_minutes(wait_seconds)}{purged}"
        return f"accepted {_minutes(round(waited))} ago, awaiting a receipt"
    return str(r["skip_reason"] or r["last_error"] or "") + purged


def to_json(data: Any) -> str:
    """One JSON document: sorted keys, times in ISO 8601."""
    return json.dumps(data, default=_default, indent=2, sort_keys=True)


def _default(value: object) -> object:
    return value.isoformat() if isinstance(value, datetime) else str(value)
