"""What operator commands print to a terminal: progress (redaction: test_redaction.py)."""

from __future__ import annotations

import io

from service.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_only_to_a_terminal_and_clears_its_line() -> None:
    piped = io.StringIO()
    progress = Progress("load", piped)
    progress.update(10, 20)
    progress.finish()
    assert piped.getvalue() == ""
    tty = _Tty()
    progress = Progress("load", tty, every_seconds=0)
    progress.update(10, 20)
    progress.update(20, 20)
    progress.finish()
    assert "load: 10/20" in tty.getvalue() and "load: 20/20" in tty.getvalue()
    assert tty.getvalue().endswith("\r\x1b[K")
