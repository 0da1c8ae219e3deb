"""Stopping a session's side tasks (consumer/session.py): a stop always ends them."""

from __future__ import annotations

import asyncio

from consumer.session import _cancel_task


async def test_a_task_that_turns_a_cancel_into_its_own_error_and_goes_on_is_still_ended() -> None:
    rounds: list[str] = []

    async def sampler() -> None:
        # As a sampler round did when a cancel landed inside a broker call: the cancel came
        # out as a library error, was logged as a failed round, and the loop slept on.
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if rounds:
                    raise
                rounds.append("swallowed")

    task = asyncio.create_task(sampler())
    await asyncio.sleep(0)  # let it start its first sleep
    async with asyncio.timeout(60):  # a regression hangs here rather than forever
        await _cancel_task(task)
    assert task.cancelled() and rounds == ["swallowed"]
