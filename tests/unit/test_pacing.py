"""The purge's pacer on a fake clock: it sleeps just enough that a window's rows over its
elapsed time stay within the cap, never when the work is already slower, banks at most its
carry of slow time, and 0 never sleeps. Its yielder waits while other work is due, polling,
up to its bound over its whole life, and 0 never asks."""

from __future__ import annotations

import pytest

from service.pacing import Pacer, Yielder


class FakeClock:
    """A clock that moves only when told to (work) or when the pacer sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _pacer(rows_per_second: float, clock: FakeClock, carry: float = 1.0) -> Pacer:
    return Pacer(rows_per_second, clock=clock, sleep=clock.sleep, carry_seconds=carry)


async def test_a_fast_batch_sleeps_until_the_window_is_back_at_the_cap() -> None:
    clock = FakeClock()
    pacer = _pacer(1000, clock)
    for _ in range(3):
        clock.now += 0.5  # 1,000 rows of work take 0.5 s: twice the cap
        assert await pacer.done(1000) == pytest.approx(0.5)
    assert clock.now == pytest.approx(103.0)  # 3,000 rows in 3 s: exactly the cap
    assert pacer.paced_seconds == pytest.approx(1.5)


async def test_work_slower_than_the_cap_never_sleeps() -> None:
    clock = FakeClock()
    pacer = _pacer(100, clock)
    clock.now += 0.5
    assert await pacer.done(10) == 0.0  # 10 rows at 100/s may take 0.1 s; they took 0.5
    assert clock.slept == [] and pacer.paced_seconds == 0.0


async def test_slow_time_is_banked_at_most_the_carry() -> None:
    clock = FakeClock()
    pacer = _pacer(100, clock, carry=1.0)
    clock.now += 10.0  # one very slow batch of 100 rows (1 s of allowance): 9 s behind
    assert await pacer.done(100) == 0.0
    # Only 1 s is carried: 100 rows free, the next 100 wait their full second.
    assert await pacer.done(100) == 0.0
    assert await pacer.done(100) == pytest.approx(1.0)


async def test_restart_opens_a_new_window_and_the_pauses_add_up() -> None:
    clock = FakeClock()
    pacer = _pacer(10, clock)
    assert await pacer.done(10) == pytest.approx(1.0)
    clock.now += 60.0  # a step with nothing to do, then the next one
    pacer.restart()
    assert await pacer.done(5) == pytest.approx(0.5)  # the idle minute is not credit
    assert pacer.paced_seconds == pytest.approx(1.5)
    assert pacer.window_paced_seconds == pytest.approx(0.5)
    assert clock.slept == [pytest.approx(1.0), pytest.approx(0.5)]


async def test_zero_is_unpaced_and_a_negative_cap_is_refused() -> None:
    clock = FakeClock()
    pacer = _pacer(0, clock)
    assert await pacer.done(1_000_000) == 0.0
    assert clock.slept == [] and pacer.paced_seconds == 0.0
    with pytest.raises(ValueError, match="0 \\(unpaced\\) or more"):
        Pacer(-1)


class Busy:
    """Says other work is due for the first ``times`` questions."""

    def __init__(self, times: int) -> None:
        self.left, self.asked = times, 0

    async def __call__(self) -> bool:
        self.asked += 1
        self.left -= 1
        return self.left >= 0


async def test_the_yielder_waits_while_work_is_due_then_not_at_all() -> None:
    clock, busy = FakeClock(), Busy(3)
    yielder = Yielder(60, busy, sleep=clock.sleep, poll_seconds=2)
    assert await yielder.wait() == 6 and clock.slept == [2, 2, 2]
    assert await yielder.wait() == 0 and busy.asked == 5  # nothing due: one question each
    assert yielder.waited_seconds == 6 and not yielder.spent


async def test_the_yielder_stops_waiting_when_its_bound_is_spent_over_all_its_waits() -> None:
    clock, busy = FakeClock(), Busy(1000)  # a backlog that never clears
    yielder = Yielder(5, busy, sleep=clock.sleep, poll_seconds=2)
    assert await yielder.wait() == 5 and clock.slept == [2, 2, 1]
    assert yielder.spent
    asked = busy.asked
    assert await yielder.wait() == 0 and busy.asked == asked  # spent: it no longer asks


async def test_a_yielder_bound_of_0_never_asks_and_never_waits() -> None:
    clock, busy = FakeClock(), Busy(1000)
    yielder = Yielder(0, busy, sleep=clock.sleep)
    assert await yielder.wait() == 0 and busy.asked == 0 and clock.slept == []
    with pytest.raises(ValueError, match="0 \\(never waits\\) or more"):
        Yielder(-1, busy)
