"""The consume loop: the only place that acknowledges a delivery message.

Per message: decode -> claim the row (batched) -> pre-send checks -> rate budget ->
send through the channel adapter -> write the attempt and the new state (batched: one
statement per group) -> publish the retry or dead letter with a confirm -> **only then
ack**. A crash anywhere before the ack means redelivery; the claim (with its lease and
attempt fence) and the receiver's idempotency key make a redelivery harmless.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from aio_pika.abc import AbstractIncomingMessage
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from consumer import budget, isolation
from consumer.channels.base import Channel, Outcome, OutcomeKind, SendRequest
from consumer.retry import Action, RetryPolicy
from service import amqp, db, ledger, logs, messages, telemetry
from service.batching import Batcher
from service.clock import Clock
from service.crashpoints import CrashPoints
from service.ledger import Claimed, Completion, State, Unclaimable
from service.telemetry import Metrics

log = logs.get("consumer")


@dataclass(frozen=True)
class WorkerConfig:
    lease_seconds: float
    write_batch_max: int
    write_concurrency: int
    budget_max_wait_seconds: float = 30.0
    budget_defer_seconds: float = 1.0
    send_timeout_seconds: float = 10.0


class Worker:
    """Handles delivery messages; construct with every dependency, then ``start()``."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        publisher: amqp.ConfirmedPublisher,
        channels: Mapping[str, Channel],
        policy: RetryPolicy,
        config: WorkerConfig,
        metrics: Metrics,
        clock: Clock,
        guard: isolation.DestinationGuard,
        budgets: budget.Budgets | None = None,
        rng: Callable[[], float] = random.random,
        crash: CrashPoints | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self._tracer = tracer or telemetry.noop_tracer()
        self._tracing = telemetry.is_recording(self._tracer)
        self._crash = crash or CrashPoints()
        self._pool = pool
        self._publisher = publisher
        self._channels = channels
        self._policy = policy
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._guard = guard
        self._budgets = budgets
        self._rng = rng
        self._claims: Batcher[int, Claimed | Unclaimable | None] = Batcher(
            self._claim_batch,
            max_size=config.write_batch_max,
            max_concurrent=config.write_concurrency,
        )
        self._completions: Batcher[Completion, bool] = Batcher(
            self._complete_batch,
            max_size=config.write_batch_max,
            max_concurrent=config.write_concurrency,
        )
        self._in_flight: set[asyncio.Task[Any]] = set()

    def start(self) -> None:
        self._claims.start()
        self._completions.start()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        """aio-pika callback, already run in its own task: track it for the drain."""
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            await self.handle(message)
        finally:
            self._in_flight.discard(task)

    async def drain(self, timeout_seconds: float) -> bool:
        """Wait for in-flight messages; True if all finished within the deadline."""
        deadline = time.monotonic() + timeout_seconds
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.wait(set(self._in_flight), timeout=deadline - time.monotonic())
        return not self._in_flight

    async def close(self) -> None:
        """Cancel what is still running (its messages are redelivered), flush writes."""
        for task in list(self._in_flight):
            task.cancel()
        if self._in_flight:
            await asyncio.wait(set(self._in_flight))
        await self._claims.close()
        await self._completions.close()

    # ------------------------------------------------------------------ batching

    async def _claim_batch(self, ids: Sequence[int]) -> list[Claimed | Unclaimable | None]:
        unique = list(dict.fromkeys(ids))
        async with self._pool.acquire() as conn:
            claimed, others = await ledger.claim(conn, unique, self._config.lease_seconds)
        # A duplicate id within one batch gets the claim once; its twin sees it as held.
        results: list[Claimed | Unclaimable | None] = []
        given: set[int] = set()
        for i in ids:
            if i in claimed and i not in given:
                given.add(i)
                results.append(claimed[i])
            elif i in claimed:
                now = self._clock.now()
                lease_end = now + timedelta(seconds=self._config.lease_seconds)
                results.append(Unclaimable(i, State.SENDING, None, lease_end, now))
            else:
                results.append(others.get(i))
        return results

    async def _complete_batch(self, completions: Sequence[Completion]) -> list[bool]:
        async with self._pool.acquire() as conn:
            written = await ledger.complete(conn, completions)
        return [c.id in written for c in completions]

    # ------------------------------------------------------------------ one message

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Process one message end to end; ack only after the outcome is durable."""
        try:
            await self._handle(message)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug or an outage (database, broker): leave the message unacked for
            # redelivery; x-delivery-limit stops a message that always fails here.
            log.exception("message handling failed", extra={"event": "handle_failed"})
            try:
                await message.nack(requeue=True)
            except Exception:
                log.warning("nack failed", extra={"event": "nack_failed"})

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        if not self._tracing:  # nothing exports spans: skip the context work entirely
            await self._handle_in_span(message, trace.INVALID_SPAN)
            return
        # One span per delivery message, a child of the publish run that sent it (the
        # trace context travels in the AMQP headers), keyed by delivery id only.
        with self._tracer.start_as_current_span(
            f"{message.routing_key or amqp.BULK} process",
            context=telemetry.extract_context(message.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "process",
                "messaging.destination.name": message.exchange or "",
                "messaging.rabbitmq.destination.routing_key": message.routing_key or "",
            },
        ) as span:
            await self._handle_in_span(message, span)

    async def _handle_in_span(self, message: AbstractIncomingMessage, span: Span) -> None:
        try:
            decoded = messages.decode(message.body)
        except messages.MessageError as exc:
            span.set_attribute("relay.poison", str(exc))
            await self._poison(message, str(exc))
            return
        span.set_attribute("relay.delivery_id", decoded.delivery_id)
        claimed_at = time.monotonic()  # before the claim: the lease ends no earlier
        result = await self._claims.submit(decoded.delivery_id)
        if result is None:
            await self._poison(message, "unknown delivery id", decoded.delivery_id)
            return
        if isinstance(result, Unclaimable):
            await self._not_claimable(message, result)
            return
        span.set_attribute("relay.attempt", result.attempts)
        if result.run_id is not None:
            span.set_attribute("relay.run_id", result.run_id)
        await self._attempt(message, result, claimed_at)

    async def _poison(
        self, message: AbstractIncomingMessage, reason: str, delivery_id: int | None = None
    ) -> None:
        headers = {amqp.REASON_HEADER: reason, "x-relay-source-queue": message.routing_key or ""}
        await self._publisher.publish_dead(
            message.body, {**telemetry.trace_headers(message.headers), **headers}
        )
        await message.ack()
        self._metrics.poison.add(1, {"reason": reason.split(":")[0]})
        self._metrics.dead_letters.add(1, {"reason": reason.split(":")[0]})
        log.warning(
            "message dead-lettered as poison",
            extra={"event": "poison", "reason": reason, "delivery_id": delivery_id},
        )

    async def _dead_letter(
        self,
        message: AbstractIncomingMessage,
        delivery_id: int,
        attempt: int,
        error: str | None,
        status: int | None,
    ) -> None:
        """Publish a dead row's dead letter, then record that the broker confirmed it."""
        await self._publisher.publish_dead(
            message.body,
            {
                **telemetry.trace_headers(message.headers),
                amqp.REASON_HEADER: error or "dead",
                "x-relay-last-status": status or 0,
                "x-relay-attempts": attempt,
                "x-relay-delivery-id": delivery_id,
            },
        )
        await ledger.mark_dead_lettered(self._pool, delivery_id, attempt)

    async def _not_claimable(self, message: AbstractIncomingMessage, row: Unclaimable) -> None:
        if row.dead_letter_missing:
            # The consumer that wrote 'dead' died before the dead letter was confirmed:
            # publish it now, from the ledger, so the dead-letter queue misses nothing.
            await self._dead_letter(message, row.id, row.attempts, row.last_error, row.last_status)
            await message.ack()
            self._metrics.dead_letters.add(1, {"reason": (row.last_error or "dead").split(":")[0]})
            log.warning(
                "missing dead letter published on redelivery",
                extra={"event": "dead_letter_recovered", "delivery_id": row.id},
            )
            return
        if row.state in ledger.FINAL_STATES:
            # Already final: a redelivery or a rescue duplicate. Never send again.
            self._metrics.duplicates.add(1, {"state": row.state.value})
            await message.ack()
            log.info(
                "duplicate message for a final row acked without sending",
                extra={"event": "duplicate", "delivery_id": row.id, "state": row.state.value},
            )
            return
        # Held by a live claim (sending) or waiting for its retry time (retrying): park
        # the message until then rather than drop it, so a lost retry message is moot.
        until = row.lease_expires_at if row.state is State.SENDING else row.next_attempt_at
        remaining = max((until - row.now).total_seconds(), 0.0) if until else 0.0
        tier = await self._publisher.publish_delayed(
            message.body,
            lane=message.routing_key or amqp.BULK,
            remaining_seconds=remaining,
            headers=telemetry.trace_headers(message.headers),
        )
        await message.ack()
        self._metrics.redelays.add(1, {"state": row.state.value})
        log.info(
            "message parked until its row is due",
            extra={
                "event": "redelay",
                "delivery_id": row.id,
                "state": row.state.value,
                "remaining_seconds": round(remaining, 3),
                "tier_seconds": tier,
            },
        )

    def _pre_send_skip(self, row: Claimed, now: datetime) -> tuple[str | None, bool]:
        """(skip reason or None, send marked stale) — checked immediately before sending."""
        if not row.active or row.destination is None or row.payload is None:
            return "cancelled", False
        if row.stale_after_seconds is not None:
            age = (now - row.occurrence_at).total_seconds()
            if age > row.stale_after_seconds:
                return (None, True) if row.send_stale else ("stale", False)
        return None, False

    async def _attempt(
        self, message: AbstractIncomingMessage, row: Claimed, claimed_at: float
    ) -> None:
        fields: dict[str, Any] = {
            "delivery_id": row.id,
            "key": row.idempotency_key,
            "run_id": row.run_id,
            "attempt": row.attempts,
        }
        now = self._clock.now()
        skip_reason, stale = self._pre_send_skip(row, now)
        if skip_reason is not None:
            await self._write(
                Completion(
                    id=row.id,
                    attempt=row.attempts,
                    state=State.SKIPPED,
                    skip_reason=skip_reason,
                    record=ledger.Attempt(outcome="skipped", error=skip_reason),
                )
            )
            await message.ack()
            self._metrics.skipped.add(1, {"reason": skip_reason, "channel": row.channel})
            log.info(
                "delivery skipped", extra={"event": "skipped", "reason": skip_reason, **fields}
            )
            return
        labels = {"channel": row.channel, "provider": row.provider}
        sent = await self._send(message, row, stale, labels, claimed_at)
        if sent is None:
            return  # deferred without an attempt
        outcome, latency, sent_at = sent
        self._metrics.attempts.add(1, {**labels, "outcome": outcome.kind.value})
        decision = self._policy.decide(
            outcome.kind,
            channel=row.channel,
            attempt=row.attempt_in_round,
            retry_after_seconds=outcome.retry_after_seconds,
            random=self._rng,
        )
        record = ledger.Attempt(
            outcome=outcome.kind.value,
            http_status=outcome.http_status,
            latency_ms=latency * 1000,
            error=outcome.error,
            response_excerpt=outcome.response_excerpt,
            payload_version=row.payload_version,
            started_at=sent_at,
            stale=stale,
        )
        if decision.action is Action.DELIVERED:
            completion = Completion(
                row.id,
                row.attempts,
                State.DELIVERED,
                status=outcome.http_status,
                receipt=outcome.receipt,
                record=record,
            )
        elif decision.action is Action.RETRY:
            assert decision.delay_seconds is not None
            completion = Completion(
                row.id,
                row.attempts,
                State.RETRYING,
                next_attempt_at=now + timedelta(seconds=decision.delay_seconds),
                status=outcome.http_status,
                error=outcome.error,
                record=record,
            )
        else:
            completion = Completion(
                row.id,
                row.attempts,
                State.DEAD,
                status=outcome.http_status,
                error=f"{decision.reason}: {outcome.error}" if outcome.error else decision.reason,
                record=record,
            )
        # Durable first: the outcome is committed before any retry/dead-letter publish
        # and before the ack. If this process dies now, redelivery finds the new state.
        written = await self._write(completion)
        self._crash.hit("after_write")
        if written and decision.action is Action.RETRY:
            assert decision.delay_seconds is not None
            await self._publisher.publish_delayed(
                message.body,
                lane=amqp.lane_of(row.urgent),
                remaining_seconds=decision.delay_seconds,
                headers=telemetry.trace_headers(message.headers),
            )
            self._metrics.retries_scheduled.add(1, labels)
        elif written and decision.action is Action.DEAD:
            await self._dead_letter(
                message, row.id, row.attempts, completion.error, outcome.http_status
            )
            self._metrics.dead_letters.add(1, {"reason": decision.reason or "dead", **labels})
        if written and decision.action is not Action.DELIVERED:
            self._crash.hit("after_publish")
        await message.ack()
        span = trace.get_current_span()
        span.set_attribute("relay.outcome", outcome.kind.value)
        span.set_attribute("relay.decision", decision.action.value)
        if outcome.http_status is not None:
            span.set_attribute("http.response.status_code", outcome.http_status)
        # ERROR only for a dead letter; a delivered one is in the ledger, so DEBUG.
        level = {Action.DEAD: 40, Action.DELIVERED: 10}.get(decision.action, 20)
        log.log(
            level,
            "delivery attempted",
            extra={
                "event": "attempt",
                "outcome": outcome.kind.value,
                "decision": decision.action.value,
                "http_status": outcome.http_status,
                "error": logs.redact(outcome.error) if outcome.error else None,
                "latency_ms": round(latency * 1000, 1),
                "fenced_out": not written,
                **fields,
            },
        )

    async def _send(
        self,
        message: AbstractIncomingMessage,
        row: Claimed,
        stale: bool,
        labels: dict[str, str],
        claimed_at: float,
    ) -> tuple[Outcome, float, datetime] | None:
        """Make the attempt through isolation and the budget; None if it was deferred."""
        channel = self._channels.get(row.channel)
        if row.destination_disabled:
            rejected = Outcome(OutcomeKind.REJECTED, error="destination disabled (410 gone)")
            return rejected, 0.0, self._clock.now()
        if channel is None:
            rejected = Outcome(OutcomeKind.REJECTED, error=f"channel {row.channel} not configured")
            return rejected, 0.0, self._clock.now()
        assert row.destination is not None and row.payload is not None
        key = isolation.destination_key(row.channel, row.provider, row.destination)
        # A broken destination is deferred before it can spend any budget.
        blocked = self._guard.check(key)
        if not blocked.admitted:
            await self._defer(message, row, blocked.retry_after_seconds, blocked.reason)
            return None
        if self._budgets is not None:
            wait_started = time.monotonic()
            got = await self._budgets.acquire(
                row.provider,
                urgent=row.urgent,
                max_wait_seconds=self._config.budget_max_wait_seconds,
            )
            waited = time.monotonic() - wait_started
            if waited > 0.001:  # recorded when a send actually waited for budget
                self._metrics.budget_wait.record(waited, labels)
            if not got:
                reason = "rate budget exhausted or paused"
                await self._defer(message, row, self._config.budget_defer_seconds, reason)
                return None
        # The destination's share is taken only for the request itself, never while
        # waiting for budget, so one provider's backlog cannot crowd out another's.
        admission = await self._guard.acquire(key)
        if not admission.admitted:
            await self._defer(message, row, admission.retry_after_seconds, admission.reason)
            return None
        failed: bool | None = None
        try:
            lease_left = self._config.lease_seconds - (time.monotonic() - claimed_at)
            if lease_left <= self._config.send_timeout_seconds:
                # The waits ate the lease: sending now could overlap another claim of the row.
                reason = "lease too short after waiting"
                await self._defer(message, row, self._config.budget_defer_seconds, reason)
                return None
            sent_at = self._clock.now()  # the attempt's started_at: just before the request
            started = time.monotonic()
            outcome = await channel.send(
                SendRequest(
                    delivery_id=row.id,
                    idempotency_key=row.idempotency_key,
                    destination=row.destination,
                    payload=row.payload,
                    attempt=row.attempts,
                    occurrence_at=row.occurrence_at,
                    stale=stale,
                )
            )
            latency = time.monotonic() - started
            failed = outcome.kind is OutcomeKind.RETRY
        finally:
            self._guard.leave(key, failed=failed)
        self._metrics.send_duration.record(latency, labels)
        self._crash.hit("after_send")
        if outcome.kind is OutcomeKind.THROTTLED and self._budgets is not None:
            # Every replica stops sending to this provider until the provider says.
            await self._budgets.pause(row.provider, outcome.retry_after_seconds or 1.0)
            self._metrics.throttles.add(1, labels)
        if outcome.disable_destination:
            await self._pool.execute(
                db.q("disable_destination"), row.destination, outcome.error or "410 gone"
            )
        return outcome, latency, sent_at

    async def _defer(
        self, message: AbstractIncomingMessage, row: Claimed, delay_seconds: float, reason: str
    ) -> None:
        """Give the claim back without counting an attempt, and park the message."""
        retry_at = self._clock.now() + timedelta(seconds=delay_seconds)
        if await ledger.release(self._pool, row.id, row.attempts, retry_at):
            await self._publisher.publish_delayed(
                message.body,
                lane=amqp.lane_of(row.urgent),
                remaining_seconds=delay_seconds,
                headers=telemetry.trace_headers(message.headers),
            )
        await message.ack()
        self._metrics.deferrals.add(1, {"reason": reason.split(":")[0]})
        log.info(
            "send deferred without an attempt",
            extra={
                "event": "deferred",
                "delivery_id": row.id,
                "reason": reason,
                "delay_seconds": round(delay_seconds, 3),
            },
        )

    async def _write(self, completion: Completion) -> bool:
        return await self._completions.submit(completion)
