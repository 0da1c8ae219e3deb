"""How many fault modules run at once, in one suite and on the whole machine.

A fault test starts servers of its own (a RabbitMQ node boots an Erlang VM, a cluster
three) and then holds the pipeline to deadlines its settings derive (a SIGTERM within the
grace, a rescue after its lease). Two suites at once on 2 cores with four workers each ran
up to eight of those modules together and missed such deadlines from load alone. So:

* in one suite, the fault modules are split into one group per CPU (``groups``), whole
  modules, longest first onto the lightest group, so pytest-xdist runs at most that many
  at once and the other workers take the rest of the suite;
* on the machine, a module holds one of ``slots()`` (one per CPU) while it runs
  (``Slot``): a lock file under the temporary directory, ``flock``-ed, released when the
  worker moves to another module or exits (a killed worker's lock goes with it). A second
  suite's fault module waits for a slot before its first test, outside the test's timeout,
  and a worker moving to its next module lets waiting ones go first, so two suites take
  turns instead of one finishing its fault modules while the other's wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

# Seconds a module took (a fresh clone, 2026-12-06, four workers): only to balance the
# groups; a module not named counts DEFAULT_WEIGHT.
WEIGHTS = {
    "tests/fault/test_rabbit_cluster.py": 226,
    "tests/fault/test_broker_outages.py": 184,
    "tests/fault/test_database_faults.py": 119,
    "tests/fault/test_channel_faults.py": 85,
    "tests/fault/test_broker_loss.py": 65,
    "tests/fault/test_nodes_smoke.py": 42,
    "tests/fault/test_failed_session_starts.py": 31,
    "tests/fault/test_postgres_failover.py": 30,
    "tests/fault/test_consumer_crash.py": 11,
    "tests/fault/test_reconciliation_crash.py": 9,
}
DEFAULT_WEIGHT = 5
# Seconds the slowest tests outside tests/fault/ took (slow_tests.txt). They start first,
# longest first (tests/conftest.py), so none is left running alone at the end: in file
# order, a 104 s test started at 380 s and ended the run 40 s after every other worker.
# The figures only order the run: a stale one costs time, never a result.
SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")
LOCKS = Path(tempfile.gettempdir()) / "relay-test-fault-slots"
# A worker that wants a slot while others wait lets them go first, for at most this long
# (then it competes); a waiter touches its mark every poll, a mark older than
# _FRESH_SECONDS is not a waiter's.
_DEFER_SECONDS = 10.0
_FRESH_SECONDS = 5.0


def slow_tests(path: Path = SLOW_TESTS) -> dict[str, int]:
    """Test (module::function, parameters left out) -> seconds, from lines of
    ``SECONDS NODEID``; ``#`` starts a comment."""
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            seconds, nodeid = line.split(maxsplit=1)
            found[nodeid] = int(seconds)
    return found


def slots() -> int:
    return max(1, os.cpu_count() or 1)


def groups(modules: Iterable[str], count: int) -> dict[str, int]:
    """Module path -> group number in ``range(count)``, longest module first onto the
    group with the least weight so far (ties: the lower number)."""
    load = [0] * count
    chosen: dict[str, int] = {}
    for module in sorted(set(modules), key=lambda m: (-WEIGHTS.get(m, DEFAULT_WEIGHT), m)):
        group = min(range(count), key=lambda g: (load[g], g))
        chosen[module] = group
        load[group] += WEIGHTS.get(module, DEFAULT_WEIGHT)
    return chosen


class Slot:
    """One of ``count`` machine-wide slots, held from ``acquire`` to ``release``."""

    def __init__(self, count: int, locks: Path = LOCKS, poll_seconds: float = 0.5) -> None:
        self.count, self.locks, self.poll = count, locks, poll_seconds
        self._held: int | None = None  # the open lock file's descriptor
        self.waited_seconds = 0.0

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self) -> None:
        """Wait until one of the slots is free and take it. Someone already waiting goes
        first (up to ``_DEFER_SECONDS``): a worker that just let a slot go and wants one
        for its next module gives the waiters a turn, or another suite's waiting workers
        would starve."""
        if self._held is not None:
            return
        if not self.locks.exists():
            self.locks.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # every user's suites share the slots
                self.locks.chmod(0o1777)
        started = time.monotonic()
        while self._others_waiting() and time.monotonic() - started < _DEFER_SECONDS:
            time.sleep(self.poll)
        waiting = self.locks / f"waiting-{os.getpid()}"
        try:
            while not self._take():
                waiting.touch()
                time.sleep(self.poll)
        finally:
            waiting.unlink(missing_ok=True)
        self.waited_seconds += time.monotonic() - started

    def _take(self) -> bool:
        for n in range(self.count):
            # Read-only is enough for flock, and opens a file another user created.
            fd = os.open(self.locks / f"slot-{n}", os.O_RDONLY | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._held = fd
            return True
        return False

    def _others_waiting(self) -> bool:
        """Whether a live process other than this one is waiting for a slot (a killed
        waiter's mark is removed)."""
        for mark in self.locks.glob("waiting-*"):
            pid = int(mark.name.removeprefix("waiting-"))
            if pid == os.getpid():
                continue
            try:
                if time.time() - mark.stat().st_mtime > _FRESH_SECONDS:
                    continue  # not touched lately: not a waiter (a reused pid, say)
                os.kill(pid, 0)
            except FileNotFoundError:
                continue  # it got its slot meanwhile
            except ProcessLookupError:
                mark.unlink(missing_ok=True)
                continue
            except PermissionError:
                pass  # another user's live process
            return True
        return False

    def release(self) -> None:
        if self._held is not None:
            os.close(self._held)  # closing the descriptor releases its flock
            self._held = None
