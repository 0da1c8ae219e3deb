"""What ``/readyz`` and ``/livez`` answer for a consumer process, across its broker sessions.

The health endpoint lives as long as the process, not one broker session: while the broker
is away between two sessions the process is not ready (nothing is consumed) but alive,
since it is reconnecting within ``RELAY_BROKER_OUTAGE_MAX_SECONDS`` and exits 3 past it. A
liveness probe that failed during an outage would restart the pod long before that bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from aio_pika.abc import AbstractChannel, AbstractConnection

from consumer import worker
from consumer.outage import DatabaseWatch
from service import publishing
from service.settings import Settings


@dataclass(frozen=True)
class Session:
    """One broker session's parts the probes look at."""

    connection: AbstractConnection
    consume_channel: AbstractChannel
    publisher: publishing.ConfirmedPublisher
    watch: DatabaseWatch
    work: worker.Worker
    consuming: asyncio.Event


class Probes:
    """Readiness and liveness of this process, for the health endpoints."""

    def __init__(self, settings: Settings, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._now = monotonic
        self._session: Session | None = None
        self._between_since = monotonic()  # when the last session ended (or the process began)

    def attach(self, session: Session) -> None:
        self._session = session

    def detach(self) -> None:
        self._session = None
        self._between_since = self._now()

    async def ready(self) -> tuple[bool, dict[str, bool]]:
        """Every channel open, the database answering, and consuming (not paused)."""
        session = self._session
        if session is None:
            return False, {"broker": False, "consuming": False}
        broker_ok = not (
            session.connection.is_closed
            or session.consume_channel.is_closed
            or session.publisher.closed
        )
        db_ok = await session.watch.check()
        consuming = session.consuming.is_set() and not session.work.paused
        ok = broker_ok and db_ok and consuming
        return ok, {"broker": broker_ok, "database": db_ok, "consuming": consuming}

    def live(self) -> tuple[bool, dict[str, float]]:
        """Progress is possible: no outage past its bound, held messages keep finishing."""
        settings, session = self._settings, self._session
        if session is None:
            away = self._now() - self._between_since
            # The process exits 3 at the bound; the grace covers its drain and exit.
            bound = settings.broker_outage_max_seconds + settings.shutdown_grace_seconds
            return away <= bound, {"broker_outage_seconds": round(away, 3)}
        outage, stalled = session.watch.outage_seconds, session.work.stalled_for()
        ok = outage <= settings.database_outage_max_seconds
        ok = ok and stalled <= settings.liveness_stall_seconds
        return ok, {
            "database_outage_seconds": round(outage, 3),
            "stalled_seconds": round(stalled, 3),
        }
