"""Per-destination isolation: a bounded share of concurrency and a circuit breaker.

One destination that accepts connections and never answers must not slow the others.
Each destination (a webhook's scheme://host:port, or a provider for email/SMS) may use at
most ``max_in_flight`` of this process's sends at once; a send beyond that is deferred
rather than queued, so it does not hold a prefetch slot that healthy destinations need.
After ``failure_threshold`` consecutive failures (timeouts, connection errors, 5xx) the
circuit opens: sends are deferred without an attempt until ``cooldown_seconds`` pass,
then one probe is let through (half-open); its success closes the circuit, its failure
opens it again. State is per process: each replica learns on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class _Circuit:
    in_flight: int = 0
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False


@dataclass(frozen=True)
class Admission:
    """``admitted``, or the seconds after which to try again."""

    admitted: bool
    retry_after_seconds: float = 0.0
    reason: str = ""


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
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_in_flight
        self._threshold = failure_threshold
        self._cooldown = cooldown_seconds
        self._busy_retry = busy_retry_seconds
        self._now = monotonic
        self._circuits: dict[str, _Circuit] = {}

    def check(self, key: str) -> Admission:
        """Would a send be refused because the circuit is open? Takes no slot."""
        circuit = self._circuits.get(key)
        now = self._now()
        if circuit and circuit.failures >= self._threshold and now < circuit.open_until:
            return Admission(False, circuit.open_until - now, "circuit open")
        return Admission(True)

    def enter(self, key: str) -> Admission:
        """Admit one send to ``key`` now, or say when to try again."""
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

    def leave(self, key: str, *, failed: bool | None) -> None:
        """Record how an admitted send ended: ``failed`` (timeout, connection error, 5xx),
        answered, or ``None`` when it was not attempted after all."""
        circuit = self._circuits[key]
        circuit.in_flight -= 1
        circuit.probing = False
        if failed is None:
            return
        if failed:
            circuit.failures += 1
            if circuit.failures >= self._threshold:
                circuit.open_until = self._now() + self._cooldown
        else:
            circuit.failures = 0

    def is_open(self, key: str) -> bool:
        circuit = self._circuits.get(key)
        return bool(circuit and circuit.failures >= self._threshold)
