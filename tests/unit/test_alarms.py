"""A broker alarm as a connection sees it: listeners hear blocks, and a confirm wait does
not count the time its connection was blocked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from service import alarms


def test_listeners_hear_each_change_once_and_the_block_is_timed() -> None:
    now = [5.0]
    blocked = alarms.Blocked(monotonic=lambda: now[0])
    heard: list[tuple[bool, str, float]] = []
    blocked.listen(lambda is_blocked, reason: heard.append((is_blocked, reason, blocked.seconds())))
    blocked.block("low on memory")
    now[0] = 65.0
    blocked.block("low on memory")  # already blocked: nothing new
    blocked.unblock()
    blocked.unblock()
    assert heard == [(True, "low on memory", 0.0), (False, "", 60.0)]
    assert blocked.blocks == 1 and not blocked.is_blocked and blocked.seconds() == 0.0


async def test_a_confirm_held_up_by_a_block_is_not_a_timeout() -> None:
    blocked = alarms.Blocked()
    confirm: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(alarms.confirmed(confirm, 0.01, blocked))
    blocked.block("low on memory")
    await asyncio.sleep(0.1)  # ten confirm timeouts, all of them blocked
    assert not waiting.done()
    blocked.unblock()
    confirm.set_result("ack")  # the broker reads the publish once unblocked
    assert await waiting == "ack"


async def test_a_block_that_begins_during_the_window_lifts_its_deadline_until_it_ends() -> None:
    blocked = alarms.Blocked()
    confirm: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(alarms.confirmed(confirm, 0.05, blocked))
    await asyncio.sleep(0)  # the window is open, unblocked
    blocked.block("low on disk")
    await asyncio.sleep(0.2)  # four windows long, blocked
    assert not waiting.done()
    blocked.unblock()  # a fresh window
    confirm.set_result("ack")
    assert await waiting == "ack"


async def test_a_block_over_within_the_window_gives_one_fresh_window_not_an_endless_wait() -> None:
    blocked = alarms.Blocked()
    confirm: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(alarms.confirmed(confirm, 0.05, blocked))
    await asyncio.sleep(0)  # the first window is open
    blocked.block("low on memory")
    blocked.unblock()
    with pytest.raises(TimeoutError):  # the next window has no block in it: a real timeout
        await waiting
    assert confirm.cancelled()


async def test_without_a_block_a_missing_confirm_times_out_and_the_wait_is_cancelled() -> None:
    for blocked in (alarms.Blocked(), None):
        confirm: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await alarms.confirmed(confirm, 0.01, blocked)
        assert confirm.cancelled()


async def test_a_block_right_after_a_window_ran_out_leaves_that_timeout_alone() -> None:
    blocked = alarms.Blocked()
    loop = asyncio.get_running_loop()
    confirm: asyncio.Future[str] = loop.create_future()
    waiting = asyncio.ensure_future(alarms.confirmed(confirm, 0.01, blocked))
    await asyncio.sleep(0)  # the window is open, its deadline 10 ms away
    raised: list[BaseException] = []

    def from_the_reader(change: Callable[[], None]) -> None:
        try:
            change()
        except BaseException as exc:  # the loop would only log it
            raised.append(exc)

    # A block and its end come just after the deadline, in the same loop turn as the
    # timeout's callback: the wait is cancelled but has not left its window yet.
    loop.call_later(0.02, from_the_reader, lambda: blocked.block("low on memory"))
    loop.call_later(0.021, from_the_reader, blocked.unblock)
    time.sleep(0.05)  # noqa: ASYNC251 - a busy loop, so that all three come due at once
    with pytest.raises(TimeoutError):
        await waiting
    assert raised == []
