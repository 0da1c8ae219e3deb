"""Reconciliation of the duplicate window, before an e-mail or SMS is sent again.

An earlier attempt whose request may have reached the provider without its answer being
read — lost with a consumer that died between the provider's acceptance and the outcome
write, or cut by a timeout or a reset after connecting — leaves the ledger not knowing
whether the message exists. Sending again "with the same key" is safe only where the
provider honours keys (Resend, for 24 hours); Twilio does not. So the next claim asks the
provider first (the adapter's ``lookup``), records the question and the answer
(``service.reconciliations``), and:

* found: sends nothing; the row is ``accepted`` under that message's id (an attempt
  ``reconciled``), and receipts already recorded for it settle it in the same write;
* not found: sends now;
* the provider cannot say: the channel's policy — e-mail is sent with the same key (the
  provider answers a repeated key with the first message), SMS is held and asked again
  after ``hold_seconds`` without counting an attempt (a missed minute, never a second text).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import cast

from consumer import decisions
from consumer.channels.base import Channel, Lookup, LookupRequest, Reconcilable
from consumer.dispositions import Ack, Disposition, Redelay
from consumer.store import Store
from service import amqp, logs, receipts, reconciliations
from service.clock import Clock
from service.ledger import Claimed
from service.telemetry import Metrics

log = logs.get("consumer")

HOLD_REASON = "reconciliation: provider did not answer"


class Reconciler:
    """One per consumer; asks only for channels whose adapter can look a message up."""

    def __init__(
        self,
        *,
        store: Store,
        metrics: Metrics,
        clock: Clock,
        hold_seconds: float,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._hold_seconds = hold_seconds

    async def before_send(
        self,
        row: Claimed,
        channel: Channel,
        *,
        before_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> Disposition | None:
        """None: send (nothing to ask, or the answer says so); else what to do with the
        message, nothing having been sent. ``before_wait`` runs before the provider is
        asked: the claim's stamp is taken back for that wait (an operator's cancel meanwhile
        moves the row), and the send's last check comes after it."""
        if row.attempts < 2 or not receipts.waits_for_receipt(row.channel):
            return None
        lookup = getattr(channel, "lookup", None)
        if lookup is None or row.destination is None or row.payload is None:
            return None
        earlier = await self._store.reconcile_candidates(row.id, row.attempts)
        if not earlier:
            return None
        asked = LookupRequest(
            delivery_id=row.id,
            idempotency_key=row.idempotency_key,
            destination=row.destination,
            payload=row.payload,
            since=row.occurrence_at,
        )
        if before_wait is not None:
            await before_wait()
        answer = await cast(Reconcilable, channel).lookup(asked)
        policy = reconciliations.policy_for(row.channel, answer.answer)
        await self._store.record_reconciliation(
            reconciliations.Reconciliation(
                delivery_id=row.id,
                attempt=row.attempts,
                checked_attempts=tuple(earlier),
                answer=answer.answer,
                policy=policy,
                provider_message_id=answer.message_id if answer.answer == "found" else None,
                provider_status=answer.status,
                error=answer.error,
            )
        )
        self._log(row, earlier, answer, policy)
        if answer.answer == "found" and answer.message_id is not None:
            return await self._already_sent(row, answer.message_id)
        if policy == "hold":
            return await self._hold(row)
        return None

    async def _hold(self, row: Claimed) -> Disposition:
        """Give the claim back without counting an attempt, and park the message: the
        provider is asked again when it comes back."""
        retry_at = self._clock.now() + timedelta(seconds=self._hold_seconds)
        await self._store.release(row.id, row.attempts, retry_at)
        self._metrics.deferrals.add(1, {"reason": "reconciliation"})
        return Redelay(amqp.lane_of(row.urgent), self._hold_seconds)

    async def _already_sent(self, row: Claimed, message_id: str) -> Disposition:
        completion = decisions.reconciled(row, message_id, self._clock.now())
        labels = {"channel": row.channel, "provider": row.provider, "outcome": "reconciled"}
        self._metrics.attempts.add(1, labels)
        await self._store.complete(completion)  # fenced: a newer claim's write stands
        lane = amqp.lane_of(row.urgent)
        late = (self._clock.now() - row.occurrence_at).total_seconds()
        self._metrics.lateness.record(max(late, 0.0), {"channel": row.channel, "lane": lane})
        return Ack()

    def _log(self, row: Claimed, earlier: list[int], answer: Lookup, policy: str) -> None:
        log.info(
            "asked the provider before sending again",
            extra={
                "event": "reconciled",
                "delivery_id": row.id,
                "key": row.idempotency_key,
                "attempt": row.attempts,
                "checked_attempts": earlier,
                "answer": answer.answer,
                "policy": policy,
                "provider_message_id": answer.message_id,
                "error": answer.error,
            },
        )
