"""Progress of a long operator command on stderr, only when stderr is a terminal.

A load, a replay, a backfill or a rescue rewrites one line (``label: done/total``) at most
a few times a second; the line is cleared when the command ends, and the command prints
its one summary line as always. Piped or redirected, nothing is written here: logs and
scripts see only the summary.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, stream: TextIO | None = None, every_seconds: float = 0.2):
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._every = every_seconds
        self._last = 0.0
        try:
            self.enabled = self._stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self._shown = False

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self._every and (total is None or done < total):
            return
        self._last = now
        of = f"/{total}" if total is not None else ""
        more = f" ({note})" if note else ""
        self._stream.write(f"\r{self._label}: {done}{of}{more}\x1b[K")
        self._stream.flush()
        self._shown = True

    def finish(self) -> None:
        """Clear the progress line (the command prints its summary line next)."""
        if self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False
