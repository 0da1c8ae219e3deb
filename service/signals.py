"""Stop signals of a relay process. In a long-running one (``relay consume``, ``relay
console``, ``relay receipts``) SIGTERM and SIGINT set one event; in a run (``relay
publish``) they cancel it. The handlers that were there before come back afterwards."""

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


@contextlib.contextmanager
def cancelling_on_signals() -> Iterator[None]:
    """SIGTERM/SIGINT cancel the current task while the block runs (a short-lived command:
    ``relay publish``); the cancellation they cause ends the block quietly, so the code
    after it runs, while any other cancellation propagates."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    signalled = False

    def cancel() -> None:
        nonlocal signalled
        if not signalled:  # a second signal changes nothing: the first is being handled
            signalled = True
            task.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, cancel)
    try:
        yield
    except asyncio.CancelledError:
        if not signalled:
            raise
        task.uncancel()  # handled: later timeouts in this task work as timeouts again
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
