"""What a publish run counted and how it ended (``relay publish``'s output and exit code)."""

from __future__ import annotations

from dataclasses import dataclass, field

from service import errors


@dataclass
class RunCounts:
    due: int = 0
    created: int = 0
    skipped: int = 0
    published: int = 0
    rescued: int = 0
    failed: int = 0


@dataclass
class RunResult:
    run_id: int
    status: str  # ok | incomplete | paused | interrupted (stopped by a signal)
    counts: RunCounts = field(default_factory=RunCounts)
    error: str | None = None
    broker_unreachable: bool = False

    @property
    def exit_code(self) -> int:
        if self.status in ("ok", "paused"):
            return errors.ExitCode.OK
        if self.broker_unreachable:
            return errors.ExitCode.UNAVAILABLE
        return errors.ExitCode.INCOMPLETE
