"""The consume loop: what each delivery message needs, decided once per message.

Per message: decode (bounded) -> claim the row (grouped) -> deliver (``consumer.delivery``:
checks, gate, request, outcome written) -> a ``Disposition`` -> ``handle`` hands it to the
``Settler`` (``consumer/settle.py``, the only code that acks): publish the retry copy or
the dead letter with a confirm, and **only then ack**. A crash anywhere before the ack
means redelivery; the claim (with its lease and attempt fence) and the receiver's
idempotency key make a redelivery harmless.

Each message runs in a task this worker owns (``accept``), not in aiormq's, which it
cancels when the channel closes (cutting a request on the wire). So a lost channel ends
a session through the shutdown SIGTERM takes: work in flight finishes and is recorded.

Shutdown (``stop_intake`` then ``drain`` then ``close``; the session closes the store
after it): no new claims; claims whose request cannot finish within the grace period are
released without an attempt and their messages handed back; requests already on the wire
are awaited. A broker alarm ``pause``s intake: new messages wait unclaimed until
``resume``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from consumer import decisions
from consumer.acks import GroupedAcks
from consumer.delivery import Deliverer
from consumer.dispositions import Ack, DeadLetter, Disposition, GiveBack, Redelay, Requeue
from consumer.incoming import Incoming
from consumer.settle import Settler
from consumer.store import Store
from service import amqp, errors, logs, messages, telemetry
from service.ledger import Unclaimable
from service.telemetry import Metrics

log = logs.get("consumer")

# Time kept at the end of the grace period to give claims back and close.
_GIVE_BACK_SECONDS = 2.0
# A message this early for its row is held until due instead of parked in a delay tier.
_EARLY_WAIT_SECONDS = 2.0


@dataclass(frozen=True)
class WorkerConfig:
    send_timeout_seconds: float = 10.0
    # The queue each lane is consumed from (span names); the lane itself when unknown.
    lane_queues: dict[str, str] = field(default_factory=dict)


class Worker:
    """Handles delivery messages; construct with every dependency."""

    def __init__(
        self,
        *,
        store: Store,
        deliverer: Deliverer,
        settler: Settler,
        config: WorkerConfig,
        metrics: Metrics,
        stopping: asyncio.Event,
        acks: GroupedAcks | None = None,
        tracer: trace.Tracer | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._deliverer = deliverer
        self._settler = settler
        self._config = config
        self._metrics = metrics
        self._stopping = stopping
        self._acks = acks
        self._tracer = tracer or telemetry.noop_tracer()
        self._tracing = telemetry.is_recording(self._tracer)
        self._now = monotonic
        self._no_new_requests = asyncio.Event()
        self._intake_open = asyncio.Event()  # cleared while a broker alarm pauses intake
        self._intake_open.set()
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._last_progress = monotonic()
        self._closed = False
        self._redelay_lines = logs.OnePerInterval(logs.REPEAT_EVERY_SECONDS, monotonic)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def left_to_broker(self) -> int:
        """Messages settled after their channel closed: the broker has them back."""
        return self._settler.left_to_broker

    @property
    def paused(self) -> bool:
        return not self._intake_open.is_set()

    def stalled_for(self) -> float:
        """Seconds since a message was last settled while messages are held (else 0)."""
        if not self._in_flight or self.paused:
            return 0.0
        return self._now() - self._last_progress

    def accept(self, message: Incoming) -> None:
        """The consume callback: handle ``message`` in a task of ours, tracked for drains."""
        if self._closed:
            return  # delivered as the session closed: the broker gets it back with the channel
        if not self._in_flight:
            self._last_progress = self._now()  # idle until now is not a stall
        if self._acks is not None and message.delivery_tag is not None:
            self._acks.opened(message.delivery_tag)
        task = asyncio.get_running_loop().create_task(self.handle(message))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    def pause(self) -> None:
        """A broker alarm: claim nothing more until ``resume``; claimed work goes on."""
        self._intake_open.clear()

    def resume(self) -> None:
        if self.paused:
            self._last_progress = self._now()  # the pause was not a stall
            self._intake_open.set()

    # ------------------------------------------------------------------ shutdown

    def stop_intake(self, *, grace_ends_at: float) -> None:
        """Claim nothing more; let a request start only if it can end by ``grace_ends_at``
        (monotonic). Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._store.stop_claims()
        last_start = grace_ends_at - _GIVE_BACK_SECONDS - self._config.send_timeout_seconds
        delay = last_start - self._now()
        if delay <= 0:
            self._no_new_requests.set()
        else:
            asyncio.get_running_loop().call_later(delay, self._no_new_requests.set)

    def give_back_now(self) -> None:
        """No request may start any more: waiting claims are given back at once."""
        self._no_new_requests.set()

    async def drain(self, deadline: float) -> bool:
        """Wait for in-flight messages until ``deadline`` (monotonic); True if all ended."""
        while self._in_flight and self._now() < deadline:
            await asyncio.wait(set(self._in_flight), timeout=deadline - self._now())
        return not self._in_flight

    async def close(self, timeout_seconds: float) -> None:
        """Cancel what is still running (its messages return to the broker), waiting for
        it at most ``timeout_seconds``. The store it writes through is closed after it."""
        self._closed = True
        for task in list(self._in_flight):
            task.cancel()
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout_seconds)

    # ------------------------------------------------------------------ one message

    async def handle(self, message: Incoming) -> None:
        """Decide what the message's delivery needs, then have the settler carry it out
        (the only code that acks, nacks or publishes a copy of a delivery message)."""
        lane = message.routing_key or amqp.BULK
        try:
            disposition = await self._decide_in_span(message)
        except errors.Abandoned:
            disposition = GiveBack(lane)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug: leave it to redelivery; x-delivery-limit stops a message that
            # always fails here.
            log.exception("message handling failed", extra={"event": "handle_failed"})
            disposition = Requeue()
        await self._settler.settle(message, disposition)
        self._last_progress = self._now()

    async def _decide_in_span(self, message: Incoming) -> Disposition:
        if not self._tracing:  # nothing exports spans: skip the context work entirely
            return await self._decide(message, trace.INVALID_SPAN)
        # One span per delivery message, its own trace's root, linked to the publish run
        # that sent it (the run's context travels in the AMQP headers): batch -> message
        # links, per the messaging conventions, so a run is not one enormous trace.
        lane = message.routing_key or amqp.BULK
        queue = self._config.lane_queues.get(lane, lane)
        with self._tracer.start_as_current_span(
            f"process {queue}",
            context=Context(),
            kind=SpanKind.CONSUMER,
            links=telemetry.links_from(message.headers),
            attributes={
                "messaging.system": "rabbitmq",
                "messaging.operation.name": "process",
                "messaging.operation.type": "process",
                # RabbitMQ's convention: the destination is the exchange (+ routing key).
                "messaging.destination.name": message.exchange or "",
                "messaging.destination.subscription.name": queue,
                "messaging.rabbitmq.destination.routing_key": lane,
            },
        ) as span:
            disposition = await self._decide(message, span)
            span.set_attribute("relay.disposition", type(disposition).__name__.lower())
            return disposition

    async def _decide(self, message: Incoming, span: Span) -> Disposition:
        lane = message.routing_key or amqp.BULK
        try:
            decoded = messages.decode(message.body)
        except messages.MessageError as exc:
            span.set_attribute("relay.poison", str(exc))
            return self._poison(str(exc))
        span.set_attribute("relay.delivery_id", decoded.delivery_id)
        if self.paused and not await self._until_resumed():
            return GiveBack(lane)
        if self._stopping.is_set():
            return GiveBack(lane)  # not started: hand it back untouched
        claimed_at = self._now()  # before the claim: the lease ends no earlier
        result = await self._store.claim(decoded.delivery_id)
        if isinstance(result, Unclaimable) and 0 < result.early_seconds <= _EARLY_WAIT_SECONDS:
            # Arrived a moment before its due time (clocks differ a little): hold it and
            # claim it when due, rather than park it for a whole delay tier.
            if not await self._wait_unless_stopping(result.early_seconds):
                return GiveBack(lane)
            claimed_at = self._now()
            result = await self._store.claim(decoded.delivery_id)
        if result is None:
            return self._poison("unknown delivery id", decoded.delivery_id)
        if isinstance(result, Unclaimable):
            return self._not_claimable(result, lane)
        span.set_attribute("relay.attempt", result.attempts)
        if result.run_id is not None:
            span.set_attribute("relay.run_id", result.run_id)
        return await self._deliverer.deliver(
            result, claimed_at=claimed_at, no_new_requests=self._no_new_requests
        )

    async def _until_resumed(self) -> bool:
        """Wait out a pause; False if shutdown began meanwhile."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self._intake_open, self._stopping)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return not self._stopping.is_set()

    async def _wait_unless_stopping(self, seconds: float) -> bool:
        """Sleep ``seconds``; False if shutdown began meanwhile."""
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            return True
        return False

    def _poison(self, reason: str, delivery_id: int | None = None) -> Disposition:
        label = {"reason": telemetry.label_value(reason)}
        self._metrics.poison.add(1, label)
        self._metrics.dead_letters.add(1, label)
        log.warning(
            "message dead-lettered as poison",
            extra={"event": "poison", "reason": reason, "delivery_id": delivery_id},
        )
        return DeadLetter(reason)

    def _not_claimable(self, row: Unclaimable, lane: str) -> Disposition:
        """What ``decisions.message_for_unclaimable`` says, counted and logged."""
        disposition = decisions.message_for_unclaimable(row, lane)
        if isinstance(disposition, DeadLetter):
            # The consumer that wrote 'dead' died before the dead letter was confirmed:
            # publish it now, from the ledger, so the dead-letter queue misses nothing.
            reason = telemetry.label_value(disposition.reason)
            self._metrics.dead_letters.add(1, {"reason": reason})
            log.warning(
                "missing dead letter published on redelivery",
                extra={"event": "dead_letter_recovered", "delivery_id": row.id},
            )
        elif isinstance(disposition, Ack):
            # Already final: a redelivery or a rescue duplicate. Never send again.
            self._metrics.duplicates.add(1, {"state": row.state.value})
            if row.republished:  # the overdue sweep's copy, or the original it presumed lost
                self._metrics.overdue_duplicates.add(1)
            fields = {"event": "duplicate", "delivery_id": row.id, "state": row.state.value}
            log.info(
                "duplicate message for a final row acked without sending",
                extra={**fields, "republished": row.republished},
            )
        elif isinstance(disposition, Redelay):
            self._metrics.redelays.add(1, {"state": row.state.value})
            self._redelay_lines.log(  # one INFO line a minute per state, the rest at DEBUG
                log,
                row.state.value,
                "message parked until its row is due",
                {
                    "event": "redelay",
                    "delivery_id": row.id,
                    "state": row.state.value,
                    "remaining_seconds": round(disposition.seconds, 3),
                },
            )
        return disposition
