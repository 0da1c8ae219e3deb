"""What becomes of a claimed delivery that is not sent: skipped (cancelled, stale),
dead-lettered or stopped by an operator, deferred (released without an attempt and its
message parked), given back at shutdown, or left to whoever holds its claim now.

Each returns the ``Disposition`` for the worker; none makes a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from consumer import decisions
from consumer.dispositions import Ack, DeadLetter, Disposition, GiveBack, Redelay
from consumer.store import Store
from service import amqp, logs, telemetry
from service.clock import Clock
from service.errors import Abandoned
from service.ledger import Claimed
from service.ledger.lastcheck import LastCheck
from service.telemetry import Metrics

log = logs.get("consumer")


class Unsent:
    """One per consumer process, beside the ``Deliverer``."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        clock: Clock,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._deferral_lines = logs.OnePerInterval(logs.REPEAT_EVERY_SECONDS, monotonic)

    def stopped(self, row: Claimed, check: LastCheck) -> Disposition:
        """An operator cancelled or dead-lettered the run before this claim's request: the
        row is final already. A dead-lettered row's dead letter is this message's to carry."""
        log.info(
            "claim stopped by an operator before its request",
            extra={"event": "stopped", "state": check.state.value, **fields(row)},
        )
        if not check.dead_letter_missing:
            return Ack()
        reason = check.last_error or "dead"
        labels = {"channel": row.channel, "provider": row.provider}
        self._metrics.dead_letters.add(1, {"reason": telemetry.label_value(reason), **labels})
        return DeadLetter(
            reason, dead_row=(row.id, row.attempts), headers={"x-relay-last-status": 0}
        )

    async def skip(self, row: Claimed, reason: str) -> Disposition:
        await self._store.complete(decisions.skipped(row, reason))
        self._metrics.skipped.add(
            1, {"reason": telemetry.label_value(reason), "channel": row.channel}
        )
        log.info("delivery skipped", extra={"event": "skipped", "reason": reason, **fields(row)})
        return Ack()

    async def kill(self, row: Claimed, error: str) -> Disposition:
        """An operator dead-lettered the run while this row's request was on the wire (it
        came back to be retried) or claimed: dead now, and its dead letter published."""
        if not await self._store.complete(decisions.killed(row, error)):
            return Ack()  # another claim owns the row now
        labels = {"channel": row.channel, "provider": row.provider}
        self._metrics.dead_letters.add(1, {"reason": telemetry.label_value(error), **labels})
        log.info("delivery dead-lettered by an operator", extra={"event": "killed", **fields(row)})
        return DeadLetter(
            error, dead_row=(row.id, row.attempts), headers={"x-relay-last-status": 0}
        )

    async def defer(self, row: Claimed, reason: str, seconds: float) -> Disposition:
        """Give the claim back without counting an attempt, and park the message."""
        retry_at = self._clock.now() + timedelta(seconds=seconds)
        await self._store.release(row.id, row.attempts, retry_at)
        self._metrics.deferrals.add(1, {"reason": telemetry.label_value(reason)})
        # One INFO line per reason a minute (a held destination defers every delivery of
        # it, every half minute), naming how many went to DEBUG since; each one at DEBUG.
        self._deferral_lines.log(
            log,
            reason,
            "send deferred without an attempt",
            {
                "event": "deferred",
                "delivery_id": row.id,
                "reason": reason,
                "delay_seconds": round(seconds, 3),
            },
        )
        # Parked even if the release found the claim gone: an extra message is harmless.
        return Redelay(amqp.lane_of(row.urgent), seconds)

    async def give_back(self, row: Claimed) -> Disposition:
        """Shutdown: release the claim (no attempt) and hand the message back."""
        try:
            await self._store.release(row.id, row.attempts, None)
        except Abandoned:
            pass  # the database is gone too: the lease runs out and a later claim takes it
        self._metrics.deferrals.add(1, {"reason": "shutdown"})
        log.info("claim given back at shutdown", extra={"event": "given_back", **fields(row)})
        return GiveBack(amqp.lane_of(row.urgent))

    async def claim_lost(self, row: Claimed) -> Disposition:
        """The lease ran out while the send waited (e.g. through a database outage).

        Nothing was sent. If no one took the row meanwhile, the claim is released (no
        attempt counted) and the message handed back; else the new holder has it."""
        if await self._store.release(row.id, row.attempts, None):
            log.info(
                "lease ran out before sending; handed back",
                extra={"event": "lease_expired_unsent", **fields(row)},
            )
            return GiveBack(amqp.lane_of(row.urgent))
        log.warning(
            "claim lost before sending; left to its new holder",
            extra={"event": "claim_lost", **fields(row)},
        )
        return Ack()


def fields(row: Claimed) -> dict[str, Any]:
    """The log fields that join a line to its delivery, key, run and attempt."""
    return {
        "delivery_id": row.id,
        "key": row.idempotency_key,
        "run_id": row.run_id,
        "attempt": row.attempts,
    }
