"""Reconnecting after a broker loss: the backoff schedule (jitter from an injected random
source), one line when an outage begins and one when it ends, the bound that exits 3."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from consumer import reconnect
from service import errors


def _schedule(random_value: float, attempts: int = 10) -> list[float]:
    return [reconnect.pause_seconds(n, lambda: random_value) for n in range(1, attempts + 1)]


def test_backoff_doubles_from_half_a_second_to_a_30_s_cap_with_equal_jitter() -> None:
    # random() = 0: only the fixed half of each nominal pause.
    assert _schedule(0.0) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0, 15.0]
    # random() = 0.5: three quarters of it.
    assert _schedule(0.5) == [0.375, 0.75, 1.5, 3.0, 6.0, 12.0, 22.5, 22.5, 22.5, 22.5]
    # random() near 1: the whole nominal pause, never above the cap.
    nearly_one = _schedule(0.999999)
    nominal = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    assert all(n / 2 < p <= n for p, n in zip(nearly_one, nominal, strict=True))
    assert reconnect.pause_seconds(10_000, lambda: 0.999999) <= reconnect.MAX_PAUSE_SECONDS


def test_jitter_comes_from_the_random_source_each_pause_draws_once() -> None:
    draws = iter([0.0, 1.0, 0.5])
    pauses = [reconnect.pause_seconds(3, lambda: next(draws)) for _ in range(3)]
    assert pauses == [1.0, 2.0, 1.5]  # nominal 2 s: half fixed, half scaled


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.event) for r in caplog.records if r.name == "relay.consumer"]  # type: ignore[attr-defined]


async def test_an_outage_is_one_warning_then_one_info_with_its_attempts_and_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.consumer")
    now = [10.0]
    outage = reconnect.Outage("broker connection lost", monotonic=lambda: now[0])
    failures = [OSError("refused"), TimeoutError(), errors.UnavailableError("no node")]

    async def open_session(on_consuming: Callable[[], None]) -> str:
        now[0] += 1.5
        if failures:
            raise failures.pop(0)
        on_consuming()
        on_consuming()  # said twice: logged once
        return "session ended"

    result = await reconnect.until_back(
        open_session,
        outage,
        asyncio.Event(),
        max_seconds=300.0,
        random=lambda: 0.0,
        monotonic=lambda: now[0],
        first_pause_seconds=0.001,
    )
    assert result == "session ended"
    assert _records(caplog) == [
        (logging.WARNING, "broker_reconnect"),
        (logging.INFO, "broker_reconnected"),
    ]
    back = caplog.records[-1]
    assert back.attempts == 4  # type: ignore[attr-defined]
    assert back.outage_seconds == 6.0  # type: ignore[attr-defined]
    assert back.reason == "broker connection lost"  # type: ignore[attr-defined]


async def test_past_the_outage_bound_it_gives_up_with_unavailable_naming_the_setting() -> None:
    now = [0.0]
    outage = reconnect.Outage("broker connection lost", monotonic=lambda: now[0])
    opened = 0

    async def open_session(on_consuming: Callable[[], None]) -> str:
        nonlocal opened
        opened += 1
        now[0] += 40.0  # each attempt takes 40 s (a connect timeout, say)
        raise OSError("connection refused")

    with pytest.raises(errors.UnavailableError) as raised:
        await reconnect.until_back(
            open_session,
            outage,
            asyncio.Event(),
            max_seconds=100.0,
            random=lambda: 0.0,
            monotonic=lambda: now[0],
            first_pause_seconds=0.001,
        )
    assert opened == 3  # at 0, 40 and 80 s; at 120 s the bound has passed
    assert "RELAY_BROKER_OUTAGE_MAX_SECONDS" in str(raised.value)
    assert "3 reconnect attempts" in str(raised.value)
    assert outage.ended_at is None


async def test_a_stop_during_the_pause_ends_it_without_another_attempt() -> None:
    stop = asyncio.Event()
    stop.set()
    outage = reconnect.Outage("consume channel closed")

    async def open_session(on_consuming: Callable[[], None]) -> str:
        raise AssertionError("no attempt after stop")

    result = await reconnect.until_back(
        open_session, outage, stop, max_seconds=300.0, random=lambda: 0.0
    )
    assert result is None
    assert outage.attempts == 0


def test_a_session_that_fails_right_after_an_outage_keeps_backing_off_from_there() -> None:
    now = [0.0]
    first = reconnect.Outage("broker connection lost", monotonic=lambda: now[0])
    first.attempts = 5
    now[0] = 60.0
    first.end()
    now[0] = 61.0  # the new session failed a second later
    second = reconnect.Outage("broker connection lost", monotonic=lambda: now[0])
    second.follows(first)
    assert second.next_pause(lambda: 0.0, 0.5) == reconnect.pause_seconds(6, lambda: 0.0)
    now[0] = 200.0  # a session that lived a while: a new outage starts from the beginning
    third = reconnect.Outage("broker connection lost", monotonic=lambda: now[0])
    second.ended_at = 150.0
    third.follows(second)
    assert third.next_pause(lambda: 0.0, 0.5) == 0.25
