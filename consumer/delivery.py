"""One claimed delivery, from the pre-send checks to its durable outcome.

checks (claim's facts) -> channel configured? -> gate (circuit, budget, slot, lease) ->
last check (``service.ledger.lastcheck``) -> request -> retry policy -> outcome written (fenced by
id and attempt) -> what to do with the message.

The send decision is taken at the last moment: after the last wait, one grouped statement
reads the row again and stamps it, so a cancel, a hold, a disabled destination, a throttle
pause, staleness or an operator's cancel or dead-letter of the run committed meanwhile is
obeyed, and nothing waits between that answer and the request (a send that waits for
nothing goes on its claim's reading). Nothing here touches the message: every path
returns a ``Disposition`` for the worker.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime

from consumer import decisions, gate, reconcile, registry, unsent
from consumer.channels.base import Channel, Outcome, OutcomeKind, SendRequest
from consumer.dispositions import Disposition
from consumer.retry import Action, RetryPolicy
from consumer.store import Stamp, Store
from service import amqp, destinations, logs, telemetry
from service.clock import Clock
from service.crashpoints import CrashPoints
from service.ledger import Attempt, Claimed, SendFacts, State
from service.ledger.lastcheck import LastCheck
from service.telemetry import Metrics

log = logs.get("consumer")

_UNREADABLE = "destination secret unreadable"

# A channel this replica cannot send through: let a replica that can take it meanwhile.
_UNCONFIGURED_DEFER_SECONDS = 30.0


class Deliverer:
    def __init__(
        self,
        *,
        store: Store,
        gate: gate.Gate,
        channels: Mapping[str, Channel],
        policy: RetryPolicy,
        metrics: Metrics,
        clock: Clock,
        budgets_pause: Callable[[str, float], Awaitable[None]] | None = None,
        rng: Callable[[], float] = random.random,
        crash: CrashPoints | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        targets: registry.DestinationPolicy | None = None,
        held_recheck_seconds: float = 30.0,
        reconciler: reconcile.Reconciler | None = None,  # None: never ask a provider first
    ) -> None:
        self._reconciler = reconciler
        self._held_recheck = held_recheck_seconds
        self._store = store
        self._gate = gate
        self._channels = channels
        self._policy = policy
        self._metrics = metrics
        self._clock = clock
        self._pause = budgets_pause
        self._rng = rng
        self._crash = crash or CrashPoints()
        self._now = monotonic
        self._error_lines = logs.OnePerInterval(logs.REPEAT_EVERY_SECONDS, monotonic)
        self._unsent = unsent.Unsent(store, metrics, clock, monotonic)
        self._targets = targets or registry.DestinationPolicy()
        self._registry = registry.Feedback(store, metrics, self._targets)

    async def deliver(
        self, row: Claimed, *, claimed_at: float, no_new_requests: asyncio.Event
    ) -> Disposition:
        """Attempt ``row`` (claimed at monotonic ``claimed_at``); what to do with its message."""
        has_destination = row.destination is not None and row.payload is not None
        # A rate-limited provider's pause is waited out by its budget (the tokens carry it).
        budgeted = self._gate.rate_limited(row.provider)
        verdict = self._verdict(row.facts, has_destination, budget_obeys_pause=budgeted)
        if not isinstance(verdict, decisions.Send):
            return await self._without_request(row, verdict)
        channel = self._channels.get(row.channel)
        if channel is None:
            self._log_unconfigured(row.channel)
            return await self._unsent.defer(
                row, "channel not configured", _UNCONFIGURED_DEFER_SECONDS
            )
        stamp = self._store.stamp(row)  # the claim is the last check until a wait
        if self._reconciler is not None:  # an earlier attempt may have reached the provider
            settled = await self._reconciler.before_send(row, channel, before_wait=stamp.undo)
            if settled is not None:
                return settled  # the provider had it already, or cannot say yet: not sent
        try:
            secrets = self._own_secrets(row)
        except ValueError:
            self._log_unreadable(row.id)
            return await self._unsent.defer(row, _UNREADABLE, self._targets.hold_seconds)
        admitted = await self._gate.admit(
            row, claimed_at=claimed_at, no_new_requests=no_new_requests, before_wait=stamp.undo
        )
        if isinstance(admitted, gate.Stopped):
            return await self._unsent.give_back(row)
        if isinstance(admitted, gate.Defer):
            return await self._unsent.defer(row, admitted.reason, admitted.seconds)
        with admitted as slot:  # given back on leaving, used or not
            cleared = await self._last_check(row, slot, stamp, verdict, no_new_requests)
            if not isinstance(cleared, decisions.Send):
                return cleared  # not sent: skipped, deferred, given back or stopped
            # Nothing waits between the last check and the request.
            outcome, started_at, latency = await self._request(channel, row, cleared.stale, secrets)
            slot.answered(outcome)  # back at once; the destination's circuit hears how it ended
        self._crash.hit("after_send")
        labels = {"channel": row.channel, "provider": row.provider}
        self._metrics.send_duration.record(latency, labels)
        record = decisions.attempt_record(
            row, outcome, started_at=started_at, latency_seconds=latency, stale=cleared.stale
        )
        return await self._conclude(row, outcome, record)

    async def _last_check(
        self,
        row: Claimed,
        slot: gate.Slot,
        stamp: Stamp,
        verdict: decisions.Send,
        no_new_requests: asyncio.Event,
    ) -> decisions.Send | Disposition:
        """After every wait, immediately before the request: the row checked and stamped in
        one grouped statement, and what it says obeyed. Send: go now, nothing in between.
        If nothing waited since the claim, the claim (which read the same facts and set the
        stamp) is that check.

        If a budget token must be waited for after the check, the stamp is taken back for
        that wait and the row is checked again after it. Should the token run out during
        that second check too (the database answers slower than the budget's spend
        deadline), the send waits for its token with its stamp kept rather than loop: an
        operator's cancel then finds it on the wire, marks it and waits for its outcome."""
        for again in (True, False):
            if not stamp.held:
                checked = await self._check(row, no_new_requests)
                if not isinstance(checked, decisions.Send):
                    return checked
                verdict, stamp.held = checked, True
            ready = await self._gate.budget_for_request(
                row, slot, no_new_requests, before_wait=stamp.undo if again else None
            )
            if isinstance(ready, gate.Stopped):
                return await self._unsent.give_back(row)
            if isinstance(ready, gate.Defer):
                return await self._unsent.defer(row, ready.reason, ready.seconds)
            if ready or not again:
                return verdict
        raise AssertionError("unreachable: the second pass always returns")

    async def _check(
        self, row: Claimed, no_new_requests: asyncio.Event
    ) -> decisions.Send | Disposition:
        """One last check: Send, or what became of the row without a request."""
        has_destination = row.destination is not None and row.payload is not None
        check = await self._store.last_check(row.id, row.attempts)
        if check is None or not check.passed:
            return await self._not_passed(row, check, has_destination)
        verdict = self._verdict(check.facts, has_destination)
        if not isinstance(verdict, decisions.Send):
            return await self._without_request(row, verdict)
        short = self._gate.lease_short(check.lease_left_seconds)
        if short is not None:
            return await self._unsent.defer(row, short.reason, short.seconds)
        if no_new_requests.is_set():
            return await self._unsent.give_back(row)
        return verdict

    async def _not_passed(
        self, row: Claimed, check: LastCheck | None, has_destination: bool
    ) -> Disposition:
        """The last check did not stamp the row: an operator moved it or asked it to stop,
        its lease ran out, or another claim holds it. Nothing is sent in any case."""
        if check is not None and check.moved_under(row.attempts):
            return self._unsent.stopped(row, check)
        ours = check is not None and check.state is State.SENDING and check.attempts == row.attempts
        if ours and check is not None and check.facts.stop_action is not None:
            return await self._without_request(row, self._verdict(check.facts, has_destination))
        return await self._unsent.claim_lost(row)

    async def _pause_provider(self, provider: str, seconds: float) -> None:
        """Every replica stops sending to this provider until the provider says. This
        replica's pause holds even if the shared one cannot be written now: the outcome
        is still recorded, and the row's retry waits for the provider's time anyway."""
        assert self._pause is not None
        try:
            await self._pause(provider, seconds)
        except Exception as exc:
            log.warning(
                "throttle pause not shared with other replicas",
                extra={"event": "pause_not_shared", "error": type(exc).__name__},
            )

    def _verdict(
        self, facts: SendFacts, has_destination: bool, *, budget_obeys_pause: bool = False
    ) -> decisions.Verdict:
        return decisions.verdict(
            facts,
            has_destination=has_destination,
            hold_seconds=self._targets.hold_seconds,
            held_recheck_seconds=self._held_recheck,
            budget_obeys_pause=budget_obeys_pause,
        )

    def _own_secrets(self, row: Claimed) -> tuple[str, ...] | None:
        """The destination's own secrets, decrypted (None: it has none; the channel's
        configured ones sign). ValueError when they cannot be opened: never sent unsigned
        or signed with another's secret."""
        if not row.target.secrets:
            return None
        vault = self._targets.vault
        if vault is None:
            raise ValueError("no RELAY_DESTINATION_SECRETS_KEYS")
        return tuple(vault.decrypt(token) for token in row.target.secrets)

    async def _request(
        self, channel: Channel, row: Claimed, stale: bool, secrets: tuple[str, ...] | None
    ) -> tuple[Outcome, datetime, float]:
        assert row.destination is not None and row.payload is not None
        started_at = self._clock.now()  # recorded: the moment the request goes out
        started = self._now()
        outcome = await channel.send(
            SendRequest(
                delivery_id=row.id,
                idempotency_key=row.idempotency_key,
                destination=row.destination,
                payload=row.payload,
                attempt=row.attempts,
                occurrence_at=row.occurrence_at,
                stale=stale,
                signing_secrets=secrets,
                envelope=row.target.envelope,
                event_type=row.target.event_type or destinations.DEFAULT_EVENT_TYPE,
            )
        )
        return outcome, started_at, self._now() - started

    async def _without_request(self, row: Claimed, verdict: decisions.Verdict) -> Disposition:
        if isinstance(verdict, decisions.Skip):
            return await self._unsent.skip(row, verdict.reason)
        if isinstance(verdict, decisions.Hold):
            return await self._unsent.defer(row, verdict.reason, verdict.seconds)
        if isinstance(verdict, decisions.Kill):
            return await self._unsent.kill(row, verdict.error)
        assert isinstance(verdict, decisions.Refuse)
        outcome = decisions.refused(verdict.error)
        record = decisions.attempt_record(
            row, outcome, started_at=None, latency_seconds=0.0, stale=False
        )
        return await self._conclude(row, outcome, record)

    async def _learn(self, row: Claimed, outcome: Outcome) -> None:
        """What an attempt's outcome tells beyond its own row, in one place once it is
        known and before it is written: a throttle pauses the provider's budget on every
        replica; the destinations registry hears a 410, a failure or a success
        (``registry.lesson``). The destination's circuit heard it as its slot went back."""
        if outcome.kind is OutcomeKind.THROTTLED and self._pause is not None:
            await self._pause_provider(row.provider, outcome.retry_after_seconds or 1.0)
            self._metrics.throttles.add(1, {"channel": row.channel, "provider": row.provider})
        await self._registry.outcome(row, outcome)

    async def _conclude(self, row: Claimed, outcome: Outcome, record: Attempt) -> Disposition:
        """Every attempt's outcome ends here, sent or refused: learnt from, decided by the
        retry policy, written (fenced), then what becomes of its message."""
        await self._learn(row, outcome)
        labels = {"channel": row.channel, "provider": row.provider}
        self._metrics.attempts.add(1, {**labels, "outcome": outcome.kind.value})
        decision = self._policy.decide(
            outcome.kind,
            channel=row.channel,
            attempt=row.attempt_in_round,
            retry_after_seconds=outcome.retry_after_seconds,
            random=self._rng,
        )
        completion = decisions.after_attempt(row, outcome, decision, record, now=self._clock.now())
        # Durable first: the outcome is committed before any retry/dead-letter publish
        # and before the ack. If this process dies now, redelivery finds the new state.
        written = await self._store.complete(completion)
        self._crash.hit("after_write")
        # ERROR only for a dead letter; a delivered one is in the ledger, so DEBUG (and
        # its fields are not even assembled unless DEBUG is on: the hot path).
        level = {Action.DEAD: 40, Action.DELIVERED: 10}.get(decision.action, 20)
        if log.isEnabledFor(level):
            log.log(
                level,
                "delivery attempted",
                extra={
                    "event": "attempt",
                    "outcome": outcome.kind.value,
                    "decision": decision.action.value,
                    "http_status": outcome.http_status,
                    "error": logs.redact(outcome.error) if outcome.error else None,
                    "latency_ms": round((record.latency_ms or 0.0), 1),
                    "fenced_out": not written,
                    **unsent.fields(row),
                },
            )
        if written and decision.action is Action.RETRY:
            self._metrics.retries_scheduled.add(1, labels)
        elif written and decision.action is Action.DELIVERED:
            late = (self._clock.now() - row.occurrence_at).total_seconds()
            lane = amqp.lane_of(row.urgent)
            self._metrics.lateness.record(max(late, 0.0), {"channel": row.channel, "lane": lane})
        elif written and decision.action is Action.DEAD:
            self._metrics.dead_letters.add(
                1, {"reason": telemetry.label_value(decision.reason or "dead"), **labels}
            )
        return decisions.message_after(row, outcome, decision, completion, written=written)

    def _log_unreadable(self, delivery_id: int) -> None:
        if self._error_lines.admit(_UNREADABLE) is not None:
            log.error(
                "a destination's own secrets cannot be decrypted (RELAY_DESTINATION_SECRETS_KEYS "
                "lacks their key); its deliveries are held",
                extra={"event": "destination_secret_unreadable", "delivery_id": delivery_id},
            )

    def _log_unconfigured(self, channel: str) -> None:
        if self._error_lines.admit(f"channel {channel}") is not None:
            log.error(
                "channel not configured on this replica; deferring its deliveries",
                extra={"event": "channel_not_configured", "channel": channel},
            )
