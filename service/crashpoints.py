"""Named crash points for fault tests: SIGKILL this very process at a named step.

Armed only through the ``RELAY_CRASH_AT`` setting (comma-separated names), which the
fault tests set on a consumer subprocess; unarmed, ``hit`` is one set lookup. A real
SIGKILL, not an exception: nothing after the point runs, no ``finally`` block, no ack.
"""

from __future__ import annotations

import os
import signal


class CrashPoints:
    """The points armed in this process."""

    def __init__(self, armed: str = "") -> None:
        self._armed = frozenset(p.strip() for p in armed.split(",") if p.strip())

    def hit(self, name: str) -> None:
        if name in self._armed:
            os.kill(os.getpid(), signal.SIGKILL)
