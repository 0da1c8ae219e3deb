"""``service.batching.Batcher``: concurrent submissions share one flush, and one bad item
fails only itself (no I/O: the flush is a function of the test)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from service.batching import Batcher
from service.errors import Abandoned


class Poison(ValueError):
    """What the fake statement raises for a bad item (as int8 overflow would)."""


class Recorder:
    """A flush that records every group it was called with."""

    def __init__(self, *, bad: set[int] = frozenset(), abandon: bool = False) -> None:  # type: ignore[assignment]
        self.bad = bad
        self.abandon = abandon
        self.groups: list[list[int]] = []

    async def __call__(self, items: Sequence[int]) -> list[str]:
        self.groups.append(list(items))
        await asyncio.sleep(0)
        if self.abandon:
            raise Abandoned("database unreachable")
        if self.bad & set(items):
            raise Poison(f"bad items {sorted(self.bad & set(items))}")
        return [f"done {i}" for i in items]


async def _submit_all(batcher: Batcher[int, str], items: list[int]) -> list[object]:
    """Submit concurrently (one task each, as the consumer's message tasks do)."""
    tasks = [asyncio.create_task(batcher.submit(i)) for i in items]
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)


async def _started(flush: Recorder, *, max_size: int = 100) -> Batcher[int, str]:
    batcher: Batcher[int, str] = Batcher(flush, max_size=max_size, max_concurrent=1)
    batcher.start()
    return batcher


async def test_concurrent_submissions_share_one_flush_and_get_their_own_results() -> None:
    flush = Recorder()
    batcher = await _started(flush)
    results = await _submit_all(batcher, [1, 2, 3, 4, 5])
    assert results == [f"done {i}" for i in [1, 2, 3, 4, 5]]
    assert flush.groups == [[1, 2, 3, 4, 5]]
    await batcher.close(1)


async def test_a_group_whose_flush_fails_for_one_item_fails_only_that_item() -> None:
    flush = Recorder(bad={3})
    batcher = await _started(flush)
    results = await _submit_all(batcher, [1, 2, 3, 4, 5])
    assert [r for i, r in enumerate(results) if i != 2] == ["done 1", "done 2", "done 4", "done 5"]
    assert isinstance(results[2], Poison)
    # The group failed once, then each item ran on its own.
    assert flush.groups == [[1, 2, 3, 4, 5], [1], [2], [3], [4], [5]]
    await batcher.close(1)


async def test_two_bad_items_in_a_group_fail_exactly_those_two() -> None:
    flush = Recorder(bad={1, 5})
    batcher = await _started(flush)
    results = await _submit_all(batcher, [1, 2, 3, 4, 5])
    failed = [i for i, r in zip([1, 2, 3, 4, 5], results, strict=True) if isinstance(r, Poison)]
    assert failed == [1, 5]
    assert results[1:4] == ["done 2", "done 3", "done 4"]
    await batcher.close(1)


async def test_a_single_item_group_that_fails_is_not_run_twice() -> None:
    flush = Recorder(bad={9})
    batcher = await _started(flush)
    results = await _submit_all(batcher, [9])
    assert isinstance(results[0], Poison)
    assert flush.groups == [[9]]
    await batcher.close(1)


async def test_abandoned_fails_the_whole_group_at_once_without_one_by_one_retries() -> None:
    flush = Recorder(abandon=True)
    batcher = await _started(flush)
    results = await _submit_all(batcher, [1, 2, 3, 4])
    assert all(isinstance(r, Abandoned) for r in results), results
    assert flush.groups == [[1, 2, 3, 4]]
    await batcher.close(1)


async def test_a_bad_item_does_not_poison_the_groups_after_it() -> None:
    flush = Recorder(bad={2})
    batcher = await _started(flush)
    first = await _submit_all(batcher, [1, 2])
    second = await _submit_all(batcher, [3, 4])
    assert isinstance(first[1], Poison) and first[0] == "done 1"
    assert second == ["done 3", "done 4"]
    assert flush.groups[-1] == [3, 4]  # grouped again: no lasting one-by-one mode
    await batcher.close(1)


async def test_groups_are_bounded_by_max_size() -> None:
    flush = Recorder()
    batcher = await _started(flush, max_size=2)
    results = await _submit_all(batcher, [1, 2, 3, 4, 5])
    assert results == [f"done {i}" for i in [1, 2, 3, 4, 5]]
    assert all(len(g) <= 2 for g in flush.groups)
    assert sorted(i for g in flush.groups for i in g) == [1, 2, 3, 4, 5]
    await batcher.close(1)


async def test_after_stop_intake_a_submission_is_refused_as_abandoned() -> None:
    flush = Recorder()
    batcher = await _started(flush)
    batcher.stop_intake("stopping")
    with pytest.raises(Abandoned):
        await batcher.submit(1)
    assert flush.groups == []
    await batcher.close(1)


async def test_close_during_the_one_by_one_fallback_fails_the_rest_as_abandoned() -> None:
    # A group fell back to one by one; the process is stopping. Every submitter must get
    # an answer (Abandoned: its message is handed back), none may wait forever.
    gate = asyncio.Event()

    async def flush(items: Sequence[int]) -> list[str]:
        if len(items) > 1:
            raise Poison("group failed")
        await gate.wait()  # the one-by-one statements hang (the server is slow)
        return [f"done {items[0]}"]

    batcher: Batcher[int, str] = Batcher(flush, max_size=10, max_concurrent=1)
    batcher.start()
    tasks = [asyncio.create_task(batcher.submit(i)) for i in (1, 2, 3)]
    await asyncio.sleep(0.05)
    await batcher.close(0.1)
    done, pending = await asyncio.wait(tasks, timeout=2)
    assert not pending, "submitters left waiting forever after close()"
    assert all(isinstance(t.exception(), Abandoned) for t in done)


async def _one_at_a_time(batcher: Batcher[int, str], items: list[int]) -> list[object]:
    """Submit one after another, 10 ms apart (deliveries falling due one by one)."""
    tasks = []
    for i in items:
        tasks.append(asyncio.create_task(batcher.submit(i)))
        await asyncio.sleep(0.01)
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)


async def test_without_a_linger_items_submitted_apart_are_flushed_apart() -> None:
    flush = Recorder()
    batcher = await _started(flush)
    assert await _one_at_a_time(batcher, [1, 2, 3]) == ["done 1", "done 2", "done 3"]
    assert flush.groups == [[1], [2], [3]]
    await batcher.close(1)


async def _lingering(max_size: int, linger_seconds: float) -> list[list[int]]:
    """Items 1, 2, 3 submitted 10 ms apart to a lingering batcher: the groups flushed."""
    flush = Recorder()
    batcher: Batcher[int, str] = Batcher(
        flush, max_size=max_size, max_concurrent=1, linger_seconds=linger_seconds
    )
    batcher.start()
    results = await _one_at_a_time(batcher, [1, 2, 3])
    assert results == ["done 1", "done 2", "done 3"]
    await batcher.close(1)
    return flush.groups


async def test_a_linger_groups_items_submitted_apart_in_a_batch_that_never_fills() -> None:
    # The linger is far longer than the submissions take, so the grouping is a fact; the
    # batch (room for 10) goes when the linger ends.
    assert await _lingering(max_size=10, linger_seconds=2.0) == [[1, 2, 3]]


async def test_a_batch_that_fills_while_it_lingers_goes_at_once() -> None:
    # The first item starts a 30 s linger; the third fills the batch 20 ms later, and the
    # batch goes then (the helper's 10 s deadline would fail the test otherwise).
    assert await _lingering(max_size=3, linger_seconds=30.0) == [[1, 2, 3]]


async def test_a_full_batch_does_not_linger() -> None:
    flush = Recorder()
    batcher: Batcher[int, str] = Batcher(flush, max_size=2, max_concurrent=1, linger_seconds=30.0)
    batcher.start()
    # Submitted in one tick, the batch is full at once: it goes without waiting 30 s
    # (the gather's 5 s deadline would fail the test otherwise).
    results = await _submit_all(batcher, [1, 2])
    assert results == ["done 1", "done 2"]
    assert flush.groups == [[1, 2]]
    await batcher.close(1)
