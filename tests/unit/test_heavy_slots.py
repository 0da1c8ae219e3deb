"""The suite's fault modules: split whole into one group per CPU, longest first onto the
lightest group; and a machine-wide slot per CPU, a real ``flock`` that a second holder
waits for until the first lets go."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.support import heavy


def test_groups_keep_modules_whole_and_put_the_longest_first_onto_the_lightest() -> None:
    modules = [
        "tests/fault/test_rabbit_cluster.py",  # 281
        "tests/fault/test_broker_outages.py",  # 194
        "tests/fault/test_database_faults.py",  # 135
        "tests/fault/test_broker_loss.py",  # 71
        "tests/fault/test_zzz_new.py",  # not weighed: DEFAULT_WEIGHT
        "tests/fault/test_rabbit_cluster.py",  # named twice: still one module
    ]
    chosen = heavy.groups(modules, 2)
    assert chosen == {
        "tests/fault/test_rabbit_cluster.py": 0,  # 281
        "tests/fault/test_broker_outages.py": 1,  # 194
        "tests/fault/test_database_faults.py": 1,  # 329
        "tests/fault/test_broker_loss.py": 0,  # 352
        "tests/fault/test_zzz_new.py": 1,  # 349
    }
    assert set(heavy.groups(modules, 1).values()) == {0}


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
