"""Reconnecting to the broker after a session ended on broker trouble, without a storm.

A lost broker connection (a node restarted, killed or partitioned away), a channel closed
or a consumer cancelled by the server, or a publish not confirmed ends one session (the
usual drain). Then new sessions are tried with capped exponential backoff and *equal
jitter* (half of each pause fixed, half random, from an injected random source): 0.5 s
doubling to a 30 s cap, so a fleet of replicas that lost the same node spreads its
reconnects out instead of arriving together, and each one still waits a little. It goes on
until a session consumes again, or until ``RELAY_BROKER_OUTAGE_MAX_SECONDS`` have passed
since the loss: then exit 3, and the orchestrator restarts the pod.

One outage is one WARNING line when it begins (``broker_reconnect``, with its reason) and
one INFO line when a session consumes again (``broker_reconnected``, with its duration and
the attempts it took), never a line per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiormq

from service import brokers, errors, logs

log = logs.get("consumer")
T = TypeVar("T")

FIRST_PAUSE_SECONDS = 0.5
MAX_PAUSE_SECONDS = 30.0
# What a session that cannot be opened raises: the attempt failed, the next one follows.
OPEN_FAILED: tuple[type[BaseException], ...] = (
    errors.UnavailableError,
    aiormq.exceptions.ChannelInvalidStateError,  # the connection closed while opening
    *brokers.NODE_ERRORS,
)


def pause_seconds(
    attempt: int,
    random: Callable[[], float],
    *,
    first_seconds: float = FIRST_PAUSE_SECONDS,
    max_seconds: float = MAX_PAUSE_SECONDS,
) -> float:
    """The pause before reconnect ``attempt`` (1-based): ``first * 2^(attempt-1)`` capped at
    ``max_seconds``, of which half is fixed and half scaled by ``random()`` in [0, 1)."""
    nominal = min(max_seconds, first_seconds * 2.0 ** min(attempt - 1, 62))
    return nominal / 2 + nominal / 2 * random()


class Outage:
    """One broker outage of this process: its begin and end lines, and its attempts."""

    def __init__(self, reason: str, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.reason = reason
        self._now = monotonic
        self.began = monotonic()
        self.attempts = 0
        self.ended_at: float | None = None
        self._earlier_attempts = 0  # of the outage just before, if its session failed at once
        log.warning(
            "broker lost; the session ends and reconnects",
            extra={"event": "broker_reconnect", "reason": reason},
        )

    @property
    def seconds(self) -> float:
        return (self.ended_at if self.ended_at is not None else self._now()) - self.began

    def follows(self, previous: Outage | None) -> None:
        """A session that failed soon after ``previous`` ended goes on backing off from
        where that one stopped: a broker that drops every new session is not stormed."""
        if previous is None or previous.ended_at is None:
            return
        if self.began - previous.ended_at < MAX_PAUSE_SECONDS:
            self._earlier_attempts = previous._earlier_attempts + previous.attempts

    def next_pause(self, random: Callable[[], float], first_seconds: float) -> float:
        attempt = self._earlier_attempts + self.attempts + 1
        return pause_seconds(attempt, random, first_seconds=first_seconds)

    def end(self) -> None:
        """A new session consumes: the outage is over (logged once)."""
        if self.ended_at is not None:
            return
        self.ended_at = self._now()
        log.info(
            "broker back; consuming again",
            extra={
                "event": "broker_reconnected",
                "reason": self.reason,
                "outage_seconds": round(self.seconds, 3),
                "attempts": self.attempts,
            },
        )


async def until_back(
    open_session: Callable[[Callable[[], None]], Awaitable[T]],
    outage: Outage,
    stop: asyncio.Event,
    *,
    max_seconds: float,
    random: Callable[[], float],
    monotonic: Callable[[], float] = time.monotonic,
    first_pause_seconds: float = FIRST_PAUSE_SECONDS,
) -> T | None:
    """Open sessions, pausing before each, until one runs: what it returns when it ends.

    ``open_session(on_consuming)`` raises one of ``OPEN_FAILED`` if it cannot be opened
    and calls ``on_consuming`` once it consumes (which ends the outage). None: ``stop``
    was set meanwhile. Past ``max_seconds`` since the outage began, the last error is
    raised as ``UnavailableError`` (exit 3).
    """
    last: BaseException | None = None
    while True:
        left = outage.began + max_seconds - monotonic()
        if left <= 0:
            raise _gave_up(last, outage)
        pause = min(outage.next_pause(random, first_pause_seconds), left)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause)
        if stop.is_set():
            return None
        outage.attempts += 1
        try:
            return await open_session(outage.end)
        except OPEN_FAILED as exc:
            last = exc


def _gave_up(last: BaseException | None, outage: Outage) -> errors.UnavailableError:
    why = str(last) if isinstance(last, errors.UnavailableError) else type(last).__name__
    return errors.UnavailableError(
        f"broker unusable for {outage.seconds:.0f} s (RELAY_BROKER_OUTAGE_MAX_SECONDS), "
        f"{outage.attempts} reconnect attempts: {why}"
    )
