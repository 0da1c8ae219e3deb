"""``relay runs``: list publish runs and steer one (hold, release, cancel, dead-letter).

Every action is a dry run unless ``--apply``, takes ``--reason``, is idempotent (a
second time changes nothing and records nothing) and, applied, is recorded with who,
when, why and how many rows in ``run_actions``, which ``relay status --run RUN`` shows.
A cancel or dead-letter also stops the run's claimed rows before their request, and waits
(bounded; ``--no-wait`` not) for those already on the wire: when it returns, nothing of
the run is being sent or will be sent, or it says which requests still have no outcome.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from service import db, errors
from service.ledger import control
from service.ops.deliveries import open_pool, to_json
from service.settings import Settings

_EFFECT = {
    "hold": ("held", "not sent until released (their messages are parked, no attempt)"),
    "release": ("released", "sent again"),
    "cancel": ("cancelled", "skipped (reason cancelled)"),
    "dead-letter": ("dead-lettered", "dead (replayable: relay replay --from ledger --run)"),
}


async def list_(args: argparse.Namespace, settings: Settings) -> int:
    if args.limit < 1:
        raise errors.ConfigError("--limit: must be at least 1")
    async with open_pool(settings) as pool:
        rows = await pool.fetch(db.q("runs_list"), args.limit + 1, args.before, not args.all_runs)
    found = [_run_row(dict(r)) for r in rows[: args.limit]]
    next_before = found[-1]["run_id"] if len(rows) > args.limit else None
    if args.json:
        print(to_json({"runs": found, "next_before": next_before}))
        return errors.ExitCode.OK
    print(render_runs(found, next_before))
    return errors.ExitCode.OK


def _run_row(r: dict[str, Any]) -> dict[str, Any]:
    owed = r["owed"]
    return {
        "run_id": r["id"],
        "kind": r["kind"],
        "status": r["status"],
        "held": r["held_at"] is not None,
        "held_at": r["held_at"],
        "intended_fire_at": r["intended_fire_at"],
        "started_at": r["started_at"],
        "finished_at": r["finished_at"],
        "owed": owed,
        "delivered": r["delivered"],
        "skipped": r["skipped"],
        "dead": r["dead"],
        "pending": r["open"],
        "completion_ratio": r["delivered"] / owed if owed else None,
        "rows_purged": r["purged"],  # of owed: rows retention purged (counted from the run)
    }


def render_runs(found: list[dict[str, Any]], next_before: int | None) -> str:
    if not found:
        return "no runs"
    header = (
        f"{'run':>5} {'kind':<8} {'status':<11} {'intended (UTC)':<16} {'owed':>6} "
        f"{'delivered':>9} {'skipped':>7} {'dead':>5} {'pending':>7} {'complete':>8}  held"
    )
    lines = [header, "-" * len(header)]
    for r in found:
        ratio = "-" if r["completion_ratio"] is None else f"{r['completion_ratio'] * 100:.1f}%"
        lines.append(
            f"{r['run_id']:>5} {r['kind']:<8} {r['status']:<11} "
            f"{r['intended_fire_at']:%Y-%m-%d %H:%M} {r['owed']:>6} {r['delivered']:>9} "
            f"{r['skipped']:>7} {r['dead']:>5} {r['pending']:>7} {ratio:>8}  "
            f"{'HELD' if r['held'] else ''}"
            + (f" ({r['rows_purged']} rows purged: counted)" if r["rows_purged"] else "")
        )
    if next_before is not None:
        lines.append(f"more: add --before {next_before} for the next page")
    return "\n".join(lines)


async def _act(args: argparse.Namespace, settings: Settings, action: str) -> int:
    async with open_pool(settings) as pool, pool.acquire() as conn:
        result = await control.act_on_run(
            conn, args.run, action, operator=args.operator, reason=args.reason, apply=args.apply
        )
        if result is not None and result.wire and not getattr(args, "no_wait", False):
            wait = control.wire_wait_seconds(settings.http_timeout_seconds)
            result = await control.settle(conn, result, reason=args.reason, wait_seconds=wait)
    if result is None:
        print(f"relay: no run {args.run}", file=sys.stderr)
        return errors.ExitCode.INCOMPLETE
    print(to_json(result.as_dict()) if args.json else render_action(result))
    # Waited, and some request on the wire still has no outcome: not all is known yet.
    unsettled = result.wire_outcomes is not None and result.in_flight > 0
    return errors.ExitCode.INCOMPLETE if unsettled else errors.ExitCode.OK


def render_action(result: control.ActionResult) -> str:
    run = f"run {result.run_id}"
    if result.action in control.STOPS:
        return render_stop(result)
    if not result.changed:
        already = "already held" if result.action == "hold" else "not held"
        return f"{run} {already}: nothing to do"
    done, effect = _EFFECT[result.action]
    if not result.applied:
        return (
            f"{run} would be {done}: {result.rows} rows {effect}"
            "\n  dry run: nothing changed; add --apply to do it"
        )
    return f"{run} {done}: {result.rows} rows {effect}"


def render_stop(result: control.ActionResult) -> str:
    """A cancel or dead-letter: what it moved, what it stopped before the request, what it
    found on the wire and what became of that."""
    run = f"run {result.run_id}"
    if not result.changed:
        return f"{run} has no rows to move: nothing to do (nothing of it is being sent)"
    done, effect = _EFFECT[result.action]
    claimed = result.claimed_stopped
    if not result.applied:
        waited = " (--apply waits for their outcome)" if result.on_the_wire else ""
        return (
            f"{run} would be {done}: {result.rows} rows {effect}, {claimed} of them claimed "
            f"by a consumer (stopped before their request); {result.on_the_wire} on the "
            f"wire now{waited}\n  dry run: nothing changed; add --apply to do it"
        )
    lines = [
        f"{run} {done}: {result.rows} rows {effect}, {claimed} of them claimed by a consumer "
        f"and stopped before their request (never sent); {result.on_the_wire} on the wire "
        "at the commit"
    ]
    wire = result.on_the_wire
    if wire and result.wire_outcomes is None:
        lines.append(
            f"  not waited for (--no-wait): the {wire} on the wire may still be answered; "
            f"none is sent again (relay deliveries list --run {result.run_id} shows them)"
        )
        return "\n".join(lines)
    if wire and result.wire_outcomes is not None:
        became = ", ".join(
            f"{n} {state}" for state, n in result.wire_outcomes.items() if state != "sending"
        )
        seconds = result.waited_seconds or 0.0
        lines.append(
            f"  the {wire} on the wire, after {seconds:.1f} s: {became or 'no outcome yet'}"
        )
    if result.in_flight:
        lines.append(
            f"  {result.in_flight} still without an outcome: their request may still be "
            "answered; none is sent again"
        )
    else:
        lines.append(f"  nothing of {run} is being sent or will be sent")
    return "\n".join(lines)


async def hold(args: argparse.Namespace, settings: Settings) -> int:
    return await _act(args, settings, "hold")


async def release(args: argparse.Namespace, settings: Settings) -> int:
    return await _act(args, settings, "release")


async def cancel(args: argparse.Namespace, settings: Settings) -> int:
    return await _act(args, settings, "cancel")


async def dead_letter(args: argparse.Namespace, settings: Settings) -> int:
    return await _act(args, settings, "dead-letter")
