"""What the console changes, through the same functions as the CLI.

A run is held, released, cancelled or dead-lettered with ``service.ledger.control.act_on_run``
(recorded in ``run_actions``). A replay is ``publisher.replay.Replayer.from_ledger``
(handed in by the composition root, since the operator tools never import
``publisher``): dry run first, then apply, recorded in ``replays`` with the operator and
the reason. A destination is switched with ``service.destination_switch`` as
``relay destinations disable`` / ``enable`` does: the same checks of the URL and the
reason, the same outcome, an enable's dry run first; recorded in ``destination_actions``.
Revealing a page (showing its recipients and replies unredacted) is recorded in
``console_reveals`` (who, when, which page). Every applied action is also one
``console_action`` log line (who, what, why; a destination by its reference).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg

from service import destination_switch, destinations, logs, netpolicy
from service.clock import Clock
from service.ledger import control, replays
from service.ops import redaction
from service.ops.console import data, refs

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
Replay = Callable[[str, replays.ReplayFilter, int, bool, str, str], Awaitable[ReplayResult]]
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


@dataclass(frozen=True)
class Switching:
    """What a destination switch needs beside the pool (as ``relay destinations`` has)."""

    allow: netpolicy.AllowList  # RELAY_ALLOW_NETWORKS: the URL check
    missed: destination_switch.MissedFire  # the count of owed occurrences
    clock: Clock


@dataclass
class Actions:
    pool: asyncpg.Pool
    replay: Replay
    queue_depth: QueueDepth
    switching: Switching
    key: refs.RefKey
    wire_wait_seconds: float = control.wire_wait_seconds(10.0)  # cancel, dead-letter

    async def reveal(self, operator: str, page: str) -> None:
        """Record that ``operator`` is shown ``page`` unredacted (before it is shown)."""
        at = self.switching.clock.now()
        await data.record_reveal(self.pool, operator, page, at)
        _record("reveal", operator, "", page=page)

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
        selection = replays.ReplayFilter(run_id=request.run_id, channel=request.channel)
        if request.delivery_id is not None:
            found = await data.delivery(self.pool, self.key, request.delivery_id)
            if found is None:
                raise ActionError(f"no delivery {request.delivery_id}")
            selection = replays.ReplayFilter(key=found["idempotency_key"])
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
        ``service.ledger.control`` as ``relay runs`` does; recorded in ``run_actions``."""
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
        self, operator: str, ref: str, *, enable: bool, apply: bool, reason: str
    ) -> dict[str, Any]:
        """Disable (always applied) or enable (a dry run unless ``apply``) the destination
        with this reference, as ``relay destinations disable`` / ``enable`` does: the same
        checks, the same outcome, the same JSON."""
        found = await data.destinations(self.pool, self.key, ref, 1, reveal=True)
        if not found:
            raise ActionError("no such destination")
        try:
            url = destination_switch.target(found[0]["destination"], self.switching.allow)
            async with self.pool.acquire() as conn:
                if enable:
                    result = await self._enable(conn, url, operator, apply, reason)
                else:
                    apply = True
                    done = await destination_switch.disable(
                        conn, url, operator=operator, reason=reason
                    )
                    result = destination_switch.disabled_dict(url, done)
        except destination_switch.SwitchRefused as exc:
            raise ActionError(str(exc)) from None
        if apply and result["changed"]:
            action = "destination_enable" if enable else "destination_disable"
            _record(action, operator, reason.strip(), destination_ref=ref, changed=True)
        # The URL as every console answer shows a destination: scheme and host only.
        return {**result, "destination_ref": ref, "url": redaction.destination("webhook", url)}

    async def _enable(
        self, conn: destinations.Connection, url: str, operator: str, apply: bool, reason: str
    ) -> dict[str, Any]:
        done = await destination_switch.enable(
            conn,
            url,
            now=self.switching.clock.now(),
            missed=self.switching.missed,
            apply=apply,
            operator=operator,
            reason=reason,
        )
        if done is None:
            raise ActionError("no such destination (not registered)")
        return done.as_dict()


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
