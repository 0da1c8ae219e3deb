"""Stop signals of a long-running relay process (``relay consume``, ``relay console``,
``relay receipts``): SIGTERM and SIGINT set one event, and the handlers that were there
before come back when the process stops listening."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stopping_on_signals(stop: asyncio.Event) -> Iterator[asyncio.Event]:
    """SIGTERM/SIGINT set ``stop`` (yielded) while the block runs."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
