"""A batched background job's manners (``relay purge``): a cap on rows per second (after each
batch, sleep just long enough that the rows done since the window started, over the time
since, stay within the cap), and giving way to other work that is due (``Yielder``).

The caller decides where the sleep may happen (``relay purge``: after a batch commits, never
inside a transaction or holding a row lock). Time a job spends slower than the cap is not
banked for long: at most ``carry_seconds`` of it, so a slow stretch (a busy database) never
buys a burst at full speed afterwards. The clock and the sleep are passed in, so a test can
drive it with a fake clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class Pacer:
    """At most ``rows_per_second`` rows a second over a window (0: never sleeps)."""

    def __init__(
        self,
        rows_per_second: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        carry_seconds: float = 1.0,
    ) -> None:
        if rows_per_second < 0:
            raise ValueError("rows_per_second must be 0 (unpaced) or more")
        self.rows_per_second = rows_per_second
        self.paced_seconds = 0.0  # slept so far, every window together
        self.window_paced_seconds = 0.0  # slept in this window
        self._clock, self._sleep, self._carry = clock, sleep, carry_seconds
        self._start, self._rows = clock(), 0.0

    def restart(self) -> None:
        """A new window (a new step): its own rows, from now."""
        self._start, self._rows = self._clock(), 0.0
        self.window_paced_seconds = 0.0

    async def done(self, rows: float) -> float:
        """``rows`` more are done: sleep while the window is ahead of the cap. Returns the
        seconds slept."""
        if self.rows_per_second == 0:
            return 0.0
        self._rows += rows
        ahead = self._start + self._rows / self.rows_per_second - self._clock()
        if ahead < -self._carry:
            # Behind by more than the carry: forget the rest, or the next batches would rush.
            self._start -= ahead + self._carry
            return 0.0
        if ahead <= 0:
            return 0.0
        await self._sleep(ahead)
        self.paced_seconds += ahead
        self.window_paced_seconds += ahead
        return ahead


class Yielder:
    """Waits while ``busy()`` says other work is due, polling every ``poll_seconds``, up to
    ``bound_seconds`` in all over its life (0: never waits): a background job gives way to a
    drain, but a backlog that never clears cannot hold it up for ever."""

    def __init__(
        self,
        bound_seconds: float,
        busy: Callable[[], Awaitable[bool]],
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        poll_seconds: float = 1.0,
    ) -> None:
        if bound_seconds < 0:
            raise ValueError("bound_seconds must be 0 (never waits) or more")
        self.bound_seconds = bound_seconds
        self.waited_seconds = 0.0  # in all so far
        self._busy, self._sleep, self._poll = busy, sleep, poll_seconds

    @property
    def spent(self) -> bool:
        return self.waited_seconds >= self.bound_seconds

    async def wait(self) -> float:
        """While the other work is due and the bound is not spent, wait. Returns the seconds
        waited this time (0: nothing was due, or the bound is spent)."""
        waited = 0.0
        while not self.spent and await self._busy():
            step = min(self._poll, self.bound_seconds - self.waited_seconds)
            await self._sleep(step)
            waited += step
            self.waited_seconds += step
        return waited
