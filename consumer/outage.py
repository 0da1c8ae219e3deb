"""Waiting out a database outage instead of failing deliveries.

An outage is not a delivery failure. When a statement fails because the database cannot
answer (stopped, restarting, killed, hung past the statement deadline), the caller's
statement waits here and runs again once the database answers: no attempt is counted,
no message is nacked toward the broker's poison limit, and the consumer reports
not-ready meanwhile. One probe task checks the database with capped backoff. If the
outage outlasts ``outage_max_seconds``, ``on_give_up`` is called (the consumer then
hands its messages back through the broker and exits with code 3) and every wait ends.

Only errors that say "the database cannot answer" are waited out (``db.is_unavailable``);
an error in what was asked (a bad value, a constraint) goes straight to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg

from service import db, logs
from service.errors import Abandoned

log = logs.get("consumer")

T = TypeVar("T")

_FIRST_PROBE_SECONDS = 0.1
_MAX_PROBE_SECONDS = 2.0
_READINESS_SECONDS = 1.5


class DatabaseWatch:
    """Runs statements through outages; knows whether the database answers now."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        outage_max_seconds: float,
        probe_timeout_seconds: float,
        on_give_up: Callable[[], None],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._max = outage_max_seconds
        self._probe_timeout = probe_timeout_seconds
        self._on_give_up = on_give_up
        self._now = monotonic
        self._up = asyncio.Event()
        self._up.set()
        self._closed = asyncio.Event()  # no more waiting: shutdown deadline or given up
        self._down_since: float | None = None
        self._prober: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        """False from the first failed statement until a probe succeeds."""
        return self._up.is_set()

    @property
    def outage_seconds(self) -> float:
        """How long the current outage has lasted (0 when the database answers)."""
        return 0.0 if self._down_since is None else self._now() - self._down_since

    async def run(
        self, statement: Callable[[], Awaitable[T]], *, abandon: asyncio.Event | None = None
    ) -> T:
        """Run ``statement``; through an outage, wait and run it again.

        Raises ``Abandoned`` when waiting ends without the database: at the shutdown
        deadline, when the outage passed its bound, or when ``abandon`` is set (a caller
        that would rather give its work back than wait, e.g. a claim during shutdown).
        """
        while True:
            if not self._up.is_set():
                await self._wait_until_up(abandon)
            try:
                return await statement()
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                self._trip(exc)

    async def _wait_until_up(self, abandon: asyncio.Event | None) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in (self._up, self._closed, abandon) if e]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not self._up.is_set():
            raise Abandoned("database unavailable")

    def _trip(self, exc: Exception) -> None:
        if not self._up.is_set():
            return
        self._up.clear()
        self._down_since = self._now()
        log.error(
            "database unavailable; holding messages without counting attempts",
            extra={"event": "database_unavailable", "error": type(exc).__name__},
        )
        self._prober = asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        delay = _FIRST_PROBE_SECONDS
        while not self._closed.is_set():
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self._probe_timeout):
                    await self._pool.fetchval(db.q("db_now"))
            except Exception as exc:
                if not db.is_unavailable(exc):
                    log.warning(
                        "database probe failed",
                        extra={"event": "database_probe_failed", "error": type(exc).__name__},
                    )
            else:
                log.warning(
                    "database answers again; resuming",
                    extra={
                        "event": "database_available",
                        "outage_seconds": round(self.outage_seconds, 3),
                    },
                )
                self._down_since = None
                self._up.set()
                return
            if self.outage_seconds > self._max:
                log.error(
                    "database unreachable for too long; giving up",
                    extra={
                        "event": "database_outage_exit",
                        "outage_seconds": round(self.outage_seconds, 3),
                    },
                )
                self._closed.set()
                self._on_give_up()
                return
            delay = min(delay * 2, _MAX_PROBE_SECONDS)

    async def check(self) -> bool:
        """Ask the database now (readiness); a failure starts an outage like any other."""
        if not self._up.is_set():
            return False
        try:
            # Within the health endpoint's own deadline, so a hang reads as "database": false.
            async with asyncio.timeout(min(self._probe_timeout, _READINESS_SECONDS)):
                await self._pool.fetchval(db.q("db_now"))
        except Exception as exc:
            if not db.is_unavailable(exc):
                raise
            self._trip(exc)
            return False
        return True

    def close(self) -> None:
        """End every wait now (shutdown deadline): waiting statements raise Abandoned."""
        self._closed.set()

    async def stop(self) -> None:
        """Close and wait for the probe task to end."""
        self.close()
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
