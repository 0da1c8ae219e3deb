"""A broker resource alarm as one connection sees it: ``connection.blocked`` / ``unblocked``.

While a memory or disk alarm is on, RabbitMQ blocks each connection that publishes: it
stops reading from that connection's socket (so its publishes, acks and cancels wait there,
unread) and says so with ``connection.blocked``; ``connection.unblocked`` follows when the
alarm clears. A connection that never publishes is never blocked.

aiormq reads both frames but only logs them (it negotiates the capability, and has no
callback for it), so ``watch`` wraps the connection object's two frame handlers, which
aiormq's reader looks up on the instance. ``confirmed`` waits for a publisher confirm the
way a blocked connection needs: time spent blocked does not count toward the confirm
timeout, so an alarm never turns into a "publish not confirmed" failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aio_pika.abc import AbstractConnection

from service import logs

log = logs.get("amqp")
T = TypeVar("T")

# aiormq's Connection.__handle_connection_blocked / _unblocked, as Python mangles them.
_HANDLERS = ("_Connection__handle_connection_blocked", "_Connection__handle_connection_unblocked")


class Blocked:
    """Whether the broker blocks this connection now; listeners hear each change."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._now = monotonic
        self._blocked = False
        self._listeners: list[Callable[[bool, str], None]] = []
        self.blocks = 0  # how many times it was blocked so far
        self.since: float | None = None  # monotonic start of the current block
        self.observed = False  # False: this client cannot see blocks (see ``watch``)
        # Confirm waits under way (``confirmed``) and their length: a block lifts their
        # deadline, its end gives each a fresh one.
        self._windows: dict[asyncio.Timeout, float] = {}

    @property
    def is_blocked(self) -> bool:
        return self._blocked

    def listen(self, listener: Callable[[bool, str], None]) -> None:
        """``listener(blocked, reason)`` on every change."""
        self._listeners.append(listener)

    def block(self, reason: str) -> None:
        if self.is_blocked:
            return
        self.blocks += 1
        self._blocked = True
        self.since = self._now()
        for window in self._windows:
            if not window.expired():  # one that just ran out is a timeout already
                window.reschedule(None)
        for listener in list(self._listeners):
            listener(True, reason)

    def unblock(self) -> None:
        if not self.is_blocked:
            return
        self._blocked = False
        if self._windows:
            now = asyncio.get_running_loop().time()
            for window, seconds in self._windows.items():
                if not window.expired():
                    window.reschedule(now + seconds)
        for listener in list(self._listeners):
            listener(False, "")
        self.since = None

    def seconds(self) -> float:
        """How long the current block has lasted (0 when not blocked)."""
        return 0.0 if self.since is None else self._now() - self.since

    def hold(self, window: asyncio.Timeout, seconds: float) -> None:
        """Suspend ``window`` while blocked, and restart it at ``seconds`` when unblocked."""
        if self.is_blocked:
            window.reschedule(None)
        self._windows[window] = seconds

    def release(self, window: asyncio.Timeout) -> None:
        del self._windows[window]


def watch(connection: AbstractConnection, blocked: Blocked | None = None) -> Blocked:
    """Follow ``connection.blocked`` / ``unblocked`` on ``connection`` (aio-pika over aiormq)."""
    blocked = blocked or Blocked()
    transport = connection.transport
    underlay: Any = transport.connection if transport is not None else None
    on_blocked, on_unblocked = (getattr(underlay, name, None) for name in _HANDLERS)
    if on_blocked is None or on_unblocked is None:
        # Another aiormq: nothing breaks, but an alarm is only seen as slow confirms.
        log.warning(
            "this aiormq does not expose connection.blocked; broker alarms are not seen",
            extra={"event": "broker_alarm_unobserved"},
        )
        return blocked

    async def blocked_frame(frame: Any) -> None:
        await on_blocked(frame)
        blocked.block(str(getattr(frame, "reason", "") or ""))

    async def unblocked_frame(frame: Any) -> None:
        await on_unblocked(frame)
        blocked.unblock()

    setattr(underlay, _HANDLERS[0], blocked_frame)
    setattr(underlay, _HANDLERS[1], unblocked_frame)
    blocked.observed = True
    return blocked


def announce(blocked: Blocked, role: str) -> None:
    """Log each block and its end for a process whose publishes simply wait an alarm out
    (the publish run, backfill, replay): an operator sees why a run stands still."""

    def heard(is_blocked: bool, reason: str) -> None:
        if is_blocked:
            log.warning(
                "broker alarm: connection blocked; publishes wait until it clears",
                extra={"event": "broker_blocked", "reason": reason, "role": role},
            )
        else:
            log.info(
                "broker alarm cleared; publishing resumes",
                extra={
                    "event": "broker_unblocked",
                    "blocked_seconds": round(blocked.seconds(), 3),
                    "role": role,
                },
            )

    blocked.listen(heard)


async def confirmed(publishing: Awaitable[T], timeout_seconds: float, blocked: Blocked | None) -> T:
    """Await a publish and its confirm within ``timeout_seconds`` of unblocked time.

    A window in which the connection was blocked does not count: once the block ends, a
    fresh window begins (the broker reads the publish only then). TimeoutError past it.
    One ``asyncio.timeout`` whose deadline a block lifts and its end sets again, rather
    than a task and ``asyncio.wait`` per publish: a publish run sends thousands a second
    (py-spy: ~9 % of its samples in those, ~5 % in this).
    """
    async with asyncio.timeout(timeout_seconds) as window:
        if blocked is None:
            return await publishing
        blocked.hold(window, timeout_seconds)
        try:
            return await publishing
        finally:
            blocked.release(window)
