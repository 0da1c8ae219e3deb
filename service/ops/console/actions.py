"""What the console changes, through the same functions as the CLI.

A run is held, released, cancelled or dead-lettered with ``service.control.act_on_run``
(recorded in ``run_actions``). A replay is ``publisher.replay.Replayer.from_ledger``
(handed in by the composition root, since the operator tools never import
``publisher``): dry run first, then apply, recorded in ``replays`` with the operator and
the reason. A destination is switched with ``destinations.disable`` /
``destinations.enable`` (the registry's door, as for ``relay destinations``). Every
applied action is also one ``console_action`` log line (who, what, why; a destination by
its reference).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg

from service import control, destinations, ledger, logs
from service.ops.console import data

log = logs.get("console")
MAX_REASON_CHARS = 200
REPLAY_LIMIT = 10_000


class ReplayResult(Protocol):
    """What ``publisher.replay.ReplaySummary`` tells the console."""

    apply: bool
    selected: int
    replayed: int
    requeued: int
    stale: int
    failed: int
    sample: list[int]


# (source, filters, limit, apply, operator, reason) -> the summary of a replay; source is
# "ledger" (the filters select dead rows) or "queue" (the dead-letter queue; no filters)
Replay = Callable[[str, ledger.ReplayFilter, int, bool, str, str], Awaitable[ReplayResult]]
# How many messages the broker's dead-letter queue holds (None: the broker did not say)
QueueDepth = Callable[[], Awaitable[int | None]]


class ActionError(ValueError):
    """A refused action: its message is shown to the operator (400)."""


def check_reason(reason: str, apply: bool) -> str:
    reason = reason.strip()
    if apply and not reason:
        raise ActionError("say why (a reason is recorded with the action)")
    if len(reason) > MAX_REASON_CHARS:
        raise ActionError(f"the reason is longer than {MAX_REASON_CHARS} characters")
    return reason


@dataclass(frozen=True)
class ReplayRequest:
    """Which dead deliveries to replay: one delivery, or a run and/or channel."""

    delivery_id: int | None = None
    run_id: int | None = None
    channel: str | None = None
    source: str = "ledger"  # or "queue": the dead-letter queue, judged letter by letter


@dataclass
class Actions:
    pool: asyncpg.Pool
    replay: Replay
    queue_depth: QueueDepth
    wire_wait_seconds: float = control.wire_wait_seconds(10.0)  # cancel, dead-letter

    async def replay_dead(
        self, operator: str, request: ReplayRequest, *, apply: bool, reason: str
    ) -> dict[str, Any]:
        """Dry run (``apply`` False) or apply a replay of dead deliveries, from the ledger
        (selected by delivery, run, channel) or from the dead-letter queue (all of it)."""
        reason = check_reason(reason, apply)
        if request.source not in ("ledger", "queue"):
            raise ActionError("source: ledger or queue")
        filtered = (request.delivery_id, request.run_id, request.channel) != (None, None, None)
        if request.source == "queue" and filtered:
            raise ActionError("a replay from the queue takes every dead letter: no filters")
        selection = ledger.ReplayFilter(run_id=request.run_id, channel=request.channel)
        if request.delivery_id is not None:
            found = await data.delivery(self.pool, request.delivery_id)
            if found is None:
                raise ActionError(f"no delivery {request.delivery_id}")
            selection = ledger.ReplayFilter(key=found["idempotency_key"])
        result = await self.replay(request.source, selection, REPLAY_LIMIT, apply, operator, reason)
        summary = {
            "source": request.source,
            "apply": apply,
            "selected": result.selected,
            "replayed": result.replayed,
            "requeued": result.requeued,
            "stale": result.stale,
            "failed": result.failed,
            "sample": list(result.sample),
        }
        if apply:
            _record("replay", operator, reason, replayed=result.replayed, **_fields(request))
        return summary

    async def run_action(
        self, operator: str, run_id: int, action: str, *, apply: bool, reason: str
    ) -> dict[str, Any]:
        """Hold, release, cancel or dead-letter a run (dry run unless ``apply``), through
        ``service.control`` as ``relay runs`` does; recorded in ``run_actions``."""
        if action not in control.ACTIONS:
            raise ActionError(f"action: one of {', '.join(control.ACTIONS)}")
        reason = check_reason(reason, apply)
        async with self.pool.acquire() as conn:
            result = await control.act_on_run(
                conn, run_id, action, operator=operator, reason=reason or None, apply=apply
            )
            if result is not None and result.wire:  # requests on the wire: their outcome
                result = await control.settle(
                    conn, result, reason=reason or None, wait_seconds=self.wire_wait_seconds
                )
        if result is None:
            raise ActionError(f"no run {run_id}")
        if apply and result.changed:
            _record(f"run_{action}", operator, reason, run_id=run_id, rows=result.rows)
        return result.as_dict()

    async def switch_destination(
        self, operator: str, ref: str, *, enable: bool, reason: str
    ) -> dict[str, Any]:
        """Disable or enable the destination with this reference."""
        reason = check_reason(reason, True)
        found = await data.destinations(self.pool, ref, 1)
        if not found:
            raise ActionError("no such destination")
        destination = found[0]["destination"]
        if enable:
            async with self.pool.acquire() as conn:
                back = await destinations.enable(conn, destination)
            changed = back is not None
        else:
            changed = not found[0]["disabled"]
            await destinations.disable(self.pool, destination, f"{reason} ({operator}, console)")
        action = "destination_enable" if enable else "destination_disable"
        _record(action, operator, reason, destination_ref=ref, changed=changed)
        return {"destination_ref": ref, "disabled": not enable, "changed": changed}


def _fields(request: ReplayRequest) -> dict[str, Any]:
    return {k: v for k, v in request.__dict__.items() if v is not None}


def _record(action: str, operator: str, reason: str, **fields: Any) -> None:
    log.info(
        "console action",
        extra={
            "event": "console_action",
            "action": action,
            "operator": operator,
            "reason": reason,
            **fields,
        },
    )
