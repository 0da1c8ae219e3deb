"""Per-destination isolation: a bounded share of concurrency and a circuit breaker.

One destination that accepts connections and never answers must not slow the others.
Each destination (a webhook's scheme://host:port, or a provider for email/SMS) may use at
most ``max_in_flight`` of this process's sends at once. A send beyond that may wait for a
slot, first come first served, when the wait is expected to be short: the destination is
answering (no failure streak, a send finished within ``max_wait_seconds``) and the sends
ahead would, at its recent pace, be served within ``max_wait_seconds``. A healthy
destination's slots free within milliseconds, so a burst to it simply queues; a hung or
slow one's sends are deferred rather than left holding prefetch slots that healthy
destinations need.
After ``failure_threshold`` consecutive failures (timeouts, connection errors, 5xx) the
circuit opens: sends are deferred without an attempt until ``cooldown_seconds`` pass,
then one probe is let through (half-open); its success closes the circuit, its failure
opens it again. State is per process: each replica learns on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class _Circuit:
    in_flight: int = 0
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False
    last_finished: float | None = None  # when a send to it last finished (monotonic)
    finish_gap: float | None = None  # smoothed seconds between finished sends: its pace
    # Sends waiting for a slot, first come first served; leave() hands its slot over.
    waiters: deque[asyncio.Future[bool]] = field(default_factory=deque)


@dataclass(frozen=True)
class Admission:
    """``admitted``, or the seconds after which to try again."""

    admitted: bool
    retry_after_seconds: float = 0.0
    reason: str = ""


def _settle(waiter: asyncio.Future[bool], admitted: bool) -> None:
    if not waiter.done():
        waiter.set_result(admitted)


def destination_key(channel: str, provider: str, destination: str) -> str:
    """What isolation groups by: the webhook origin, or the provider of an API channel."""
    if channel != "webhook":
        return f"{channel}:{provider}"
    parts = urlsplit(destination)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or ''}"


class DestinationGuard:
    def __init__(
        self,
        *,
        max_in_flight: int,
        failure_threshold: int,
        cooldown_seconds: float,
        busy_retry_seconds: float = 1.0,
        max_wait_seconds: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_in_flight
        self._threshold = failure_threshold
        self._cooldown = cooldown_seconds
        self._busy_retry = busy_retry_seconds
        self._max_wait = max_wait_seconds
        self._now = monotonic
        self._circuits: dict[str, _Circuit] = {}

    def check_circuit(self, key: str) -> Admission:
        """Would the circuit refuse a send now? Takes no slot (checked before any wait)."""
        circuit = self._circuits.get(key)
        now = self._now()
        if circuit and circuit.failures >= self._threshold and now < circuit.open_until:
            return Admission(False, circuit.open_until - now, "circuit open")
        return Admission(True)

    async def take_slot(self, key: str) -> Admission:
        """Take a slot of ``key``'s share for one request, waiting briefly when it is full.

        A slot taken must be given back with ``return_slot``, whatever happens next.
        """
        admission = self.try_take_slot(key)
        circuit = self._circuits[key]
        if admission.admitted or not self._may_wait(circuit):
            return admission
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        circuit.waiters.append(waiter)
        timer = loop.call_later(self._max_wait, _settle, waiter, False)
        try:
            if await waiter:
                return Admission(True)  # leave() handed its slot to this send
            return admission
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.return_slot(key, failed=None)  # handed over as it was cancelled: pass on
            raise
        finally:
            timer.cancel()
            if waiter in circuit.waiters:
                circuit.waiters.remove(waiter)

    def _may_wait(self, circuit: _Circuit) -> bool:
        if self._max_wait <= 0 or circuit.failures > 0:
            return False
        if circuit.last_finished is None or circuit.finish_gap is None:
            return len(circuit.waiters) < self._max  # no pace known yet: a share's worth
        if self._now() - circuit.last_finished > self._max_wait:
            return False  # the sends in flight are stuck
        return (len(circuit.waiters) + 1) * circuit.finish_gap <= self._max_wait

    def try_take_slot(self, key: str) -> Admission:
        """Take a slot of ``key`` now, or say when to try again."""
        circuit = self._circuits.setdefault(key, _Circuit())
        now = self._now()
        if circuit.failures >= self._threshold:
            if now < circuit.open_until:
                return Admission(False, circuit.open_until - now, "circuit open")
            if circuit.probing:
                return Admission(False, self._busy_retry, "circuit half-open: probe running")
            circuit.probing = True  # half-open: this send is the probe
        elif circuit.in_flight >= self._max:
            return Admission(False, self._busy_retry, "destination concurrency share full")
        circuit.in_flight += 1
        return Admission(True)

    def return_slot(self, key: str, *, failed: bool | None) -> None:
        """Give a slot back, saying how its request ended: ``failed`` (timeout, connection
        error, 5xx), answered, or ``None`` when no request was made after all."""
        circuit = self._circuits[key]
        circuit.in_flight -= 1
        circuit.probing = False
        now = self._now()
        if failed is not None:  # a slot given back unused says nothing about the pace
            if circuit.last_finished is not None:
                gap = now - circuit.last_finished
                previous = gap if circuit.finish_gap is None else circuit.finish_gap
                circuit.finish_gap = previous + 0.2 * (gap - previous)
            circuit.last_finished = now
        if failed:
            circuit.failures += 1
            if circuit.failures >= self._threshold:
                circuit.open_until = now + self._cooldown
        elif failed is not None:
            circuit.failures = 0
        # The freed slot goes straight to the longest-waiting send, unless the circuit opened.
        while circuit.waiters and circuit.in_flight < self._max:
            if circuit.failures >= self._threshold:
                break
            waiter = circuit.waiters.popleft()
            if not waiter.done():
                circuit.in_flight += 1
                waiter.set_result(True)
