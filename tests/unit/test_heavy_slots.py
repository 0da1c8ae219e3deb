"""The suite's fault modules: split whole into one group per CPU, longest first onto the
lightest group; and a machine-wide slot per CPU, a real ``flock`` that a second holder
waits for until the first lets go."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import heavy

REPO = Path(__file__).resolve().parents[2]


def test_groups_keep_modules_whole_and_put_the_longest_first_onto_the_lightest() -> None:
    modules = [
        "tests/fault/test_rabbit_cluster.py",  # 226
        "tests/fault/test_broker_outages.py",  # 184
        "tests/fault/test_database_faults.py",  # 119
        "tests/fault/test_broker_loss.py",  # 65
        "tests/fault/test_zzz_new.py",  # not weighed: DEFAULT_WEIGHT
        "tests/fault/test_rabbit_cluster.py",  # named twice: still one module
    ]
    chosen = heavy.groups(modules, 2)
    assert chosen == {
        "tests/fault/test_rabbit_cluster.py": 0,  # 226
        "tests/fault/test_broker_outages.py": 1,  # 184
        "tests/fault/test_database_faults.py": 1,  # 303
        "tests/fault/test_broker_loss.py": 0,  # 291
        "tests/fault/test_zzz_new.py": 0,  # 296
    }
    assert set(heavy.groups(modules, 1).values()) == {0}


def test_every_slow_test_named_exists_so_the_order_is_not_silently_stale() -> None:
    slow = heavy.slow_tests()
    assert slow, "tests/support/slow_tests.txt names no test"
    for nodeid, seconds in slow.items():
        module, function = nodeid.split("::")
        assert not module.startswith("tests/fault/"), f"{nodeid}: fault modules go by WEIGHTS"
        assert f"def {function}(" in (REPO / module).read_text(), f"{nodeid} is gone"
        assert seconds > 0


def test_slow_tests_are_read_as_seconds_and_node_ids_comments_left_out(tmp_path: Path) -> None:
    listing = tmp_path / "slow.txt"
    listing.write_text("# a comment\n\n 40 tests/a.py::test_x\n7 tests/b.py::test_y\n")
    assert heavy.slow_tests(listing) == {"tests/a.py::test_x": 40, "tests/b.py::test_y": 7}


def test_a_slot_is_waited_for_until_its_holder_lets_go(tmp_path: Path) -> None:
    first, second = heavy.Slot(1, tmp_path), heavy.Slot(1, tmp_path, poll_seconds=0.05)
    first.acquire()
    waiter = threading.Thread(target=second.acquire, daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not second.held  # the one slot is taken
    first.release()
    waiter.join(30)
    assert second.held and not first.held
    second.release()


def test_two_slots_are_two_holders_at_once(tmp_path: Path) -> None:
    slots = [heavy.Slot(2, tmp_path) for _ in range(2)]
    for slot in slots:
        slot.acquire()
    assert all(slot.held for slot in slots)
    locks = sorted(p.name for p in tmp_path.iterdir())
    assert locks == ["slot-0", "slot-1"]
    for slot in slots:
        slot.release()


_WAITER = """
import sys
from pathlib import Path
from tests.support import heavy
slot = heavy.Slot(1, Path(sys.argv[1]), poll_seconds=0.05)
slot.acquire()
print("got", flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


def test_a_worker_wanting_a_slot_again_lets_another_suites_waiter_go_first(
    tmp_path: Path,
) -> None:
    mine = heavy.Slot(1, tmp_path, poll_seconds=0.05)
    mine.acquire()
    with subprocess.Popen(
        [sys.executable, "-c", _WAITER, str(tmp_path)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as waiter:  # fmt: skip
        try:
            _first_while_waiting(mine, waiter, tmp_path / f"waiting-{waiter.pid}")
        finally:
            waiter.kill()
            mine.release()


def _first_while_waiting(mine: heavy.Slot, waiter: subprocess.Popen[str], mark: Path) -> None:
    for _ in range(600):  # its interpreter starting: up to a minute on a busy machine
        if mark.exists():
            break
        time.sleep(0.1)
    assert mark.exists(), "the other process never waited"
    mine.release()
    again = threading.Thread(target=mine.acquire, daemon=True)
    again.start()  # the next module: but someone is waiting
    assert waiter.stdout is not None and waiter.stdout.readline() == "got\n"
    assert not mine.held  # the waiter went first
    assert waiter.stdin is not None
    waiter.stdin.close()
    again.join(60)
    assert mine.held


def test_a_dead_waiters_mark_is_removed_and_does_not_count(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"waiting-{gone.pid}").touch()
    assert not heavy.Slot(1, tmp_path)._others_waiting()
    assert not (tmp_path / f"waiting-{gone.pid}").exists()
    (tmp_path / f"waiting-{os.getppid()}").touch()  # a live process
    assert heavy.Slot(1, tmp_path)._others_waiting()
