"""The destination guard: share of concurrency, bounded waiting for a slot, circuit."""

from __future__ import annotations

import asyncio

from consumer.isolation import DestinationGuard

KEY = "http://partner:80"


def _guard(
    *, max_in_flight: int = 2, max_wait: float = 1.0, threshold: int = 3
) -> DestinationGuard:
    return DestinationGuard(
        max_in_flight=max_in_flight,
        failure_threshold=threshold,
        cooldown_seconds=30.0,
        max_wait_seconds=max_wait,
    )


async def test_a_send_beyond_the_share_waits_for_the_slot_a_finished_send_frees() -> None:
    guard = _guard()
    assert (await guard.take_slot(KEY)).admitted
    assert (await guard.take_slot(KEY)).admitted
    waiting = asyncio.create_task(guard.take_slot(KEY))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    guard.return_slot(KEY, failed=False)
    assert (await asyncio.wait_for(waiting, 1)).admitted
    # The slot was handed over: the share is still full.
    assert not guard.try_take_slot(KEY).admitted


async def test_waiters_are_served_first_come_first_served() -> None:
    guard = _guard(max_in_flight=1)
    assert (await guard.take_slot(KEY)).admitted
    order: list[int] = []

    async def wait(n: int) -> None:
        assert (await guard.take_slot(KEY)).admitted
        order.append(n)

    first = asyncio.create_task(wait(1))
    await asyncio.sleep(0.01)
    guard.return_slot(KEY, failed=False)
    await asyncio.wait_for(first, 1)
    second = asyncio.create_task(wait(2))
    await asyncio.sleep(0.01)
    guard.return_slot(KEY, failed=False)
    await asyncio.wait_for(second, 1)
    assert order == [1, 2]


async def test_a_wait_that_outlasts_the_bound_is_deferred_as_share_full() -> None:
    guard = _guard(max_wait=0.05)
    await guard.take_slot(KEY)
    await guard.take_slot(KEY)
    admission = await guard.take_slot(KEY)
    assert not admission.admitted
    assert admission.reason == "destination concurrency share full"
    # The timed-out waiter is gone: a freed slot stays free for the next sender.
    guard.return_slot(KEY, failed=False)
    assert guard.try_take_slot(KEY).admitted


async def test_before_any_send_finished_no_more_than_a_share_of_sends_wait() -> None:
    guard = _guard(max_in_flight=2, max_wait=5.0)
    await guard.take_slot(KEY)
    await guard.take_slot(KEY)
    waiting = [asyncio.create_task(guard.take_slot(KEY)) for _ in range(2)]
    await asyncio.sleep(0.01)
    third = await asyncio.wait_for(guard.take_slot(KEY), 0.5)  # refused at once, not queued
    assert not third.admitted
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _paced_guard(clock: FakeClock, *, gap: float) -> DestinationGuard:
    """A guard whose destination has been finishing one send every ``gap`` seconds."""
    guard = DestinationGuard(
        max_in_flight=1,
        failure_threshold=3,
        cooldown_seconds=30.0,
        max_wait_seconds=1.0,
        monotonic=clock,
    )
    for _ in range(3):
        assert guard.try_take_slot(KEY).admitted
        clock.now += gap
        guard.return_slot(KEY, failed=False)
    assert guard.try_take_slot(KEY).admitted  # the share (1) is full again
    return guard


async def test_only_as_many_wait_as_the_destination_serves_within_the_bound() -> None:
    clock = FakeClock()
    fast = _paced_guard(clock, gap=0.01)  # 100 a second: 20 waiters are ~0.2 s of wait
    waiting = [asyncio.create_task(fast.take_slot(KEY)) for _ in range(20)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting)  # all of them queued

    slow = _paced_guard(clock, gap=0.4)  # 2.5 a second: only 2 fit in 1 s of waiting
    waiting += [asyncio.create_task(slow.take_slot(KEY)) for _ in range(2)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting)
    third = await asyncio.wait_for(slow.take_slot(KEY), 0.5)
    assert (third.admitted, third.reason) == (False, "destination concurrency share full")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_destination_that_finished_nothing_for_the_bound_is_not_waited_for() -> None:
    clock = FakeClock()
    guard = _paced_guard(clock, gap=0.01)
    clock.now += 1.5  # the send in flight hangs
    refused = await asyncio.wait_for(guard.take_slot(KEY), 0.5)
    assert not refused.admitted


async def test_a_failing_destination_is_not_waited_for() -> None:
    clock = FakeClock()
    guard = _paced_guard(clock, gap=0.01)
    guard.return_slot(KEY, failed=True)  # one failure: no waiting until a send succeeds
    assert guard.try_take_slot(KEY).admitted
    refused = await asyncio.wait_for(guard.take_slot(KEY), 0.5)
    assert not refused.admitted


async def test_an_open_circuit_is_never_waited_for_and_stops_the_hand_over() -> None:
    guard = _guard(max_in_flight=1, threshold=1)
    await guard.take_slot(KEY)
    waiting = asyncio.create_task(guard.take_slot(KEY))
    await asyncio.sleep(0.01)
    guard.return_slot(KEY, failed=True)  # opens the circuit: the waiter gets no slot
    admission = await asyncio.wait_for(waiting, 2)
    assert not admission.admitted
    refused = await asyncio.wait_for(guard.take_slot(KEY), 0.5)
    assert (refused.admitted, refused.reason) == (False, "circuit open")


async def test_a_waiter_cancelled_as_its_slot_arrives_passes_the_slot_on() -> None:
    guard = _guard(max_in_flight=1)
    await guard.take_slot(KEY)
    waiting = asyncio.create_task(guard.take_slot(KEY))
    await asyncio.sleep(0.01)
    guard.return_slot(KEY, failed=False)  # hands the slot to the waiter...
    waiting.cancel()  # ...which is cancelled before it runs again
    await asyncio.gather(waiting, return_exceptions=True)
    assert guard.try_take_slot(KEY).admitted  # the slot was given back, not leaked
