"""The timer ladder's arithmetic: a wait written in binary over queues of fixed TTL."""

from __future__ import annotations

import random

import annotated_types
import pytest

from service import timer
from service.settings import Settings


def _waited_ms(headers: dict[str, str]) -> int:
    """The time a message with these headers spends in the ladder: one TTL per 1-bit."""
    return sum(
        timer.level_ms(level)
        for level in range(timer.LEVELS)
        if headers.get(f"relay-timer-{timer.level_ms(level)}ms") == "1"
    )


def test_levels_double_from_50_ms_and_each_queue_is_named_by_its_ttl() -> None:
    assert [timer.level_ms(j) for j in range(4)] == [50, 100, 200, 400]
    assert timer.queues("relay")[:2] == ["relay.timer.50ms", "relay.timer.100ms"]
    assert len(timer.queues("relay")) == timer.LEVELS


@pytest.mark.parametrize("remaining", [0.001, 0.05, 0.051, 1.0, 4.999, 59.98, 75.0, 3599.9])
def test_a_wait_is_rounded_up_to_the_next_50_ms_never_down(remaining: float) -> None:
    waited = _waited_ms(timer.route("relay", remaining)[1]) / 1000
    assert remaining <= waited < remaining + 0.05 + 1e-9


def test_random_waits_are_never_short_and_never_a_unit_long() -> None:
    rng = random.Random(24)
    for _ in range(10_000):
        remaining = rng.uniform(0.0001, 120.0)
        waited = _waited_ms(timer.route("relay", remaining)[1]) / 1000
        assert remaining <= waited < remaining + 0.05 + 1e-9, remaining


def test_a_wait_past_the_longest_waits_the_longest_and_the_consumer_parks_the_rest() -> None:
    entrance, headers = timer.route("relay", 10 * timer.longest_seconds())
    assert entrance == timer.queues("relay")[-1]  # the top level's exchange
    assert len(headers) == timer.LEVELS and set(headers.values()) == {"1"}
    assert _waited_ms(headers) / 1000 == timer.longest_seconds()


def test_the_ladder_holds_the_longest_look_ahead_the_settings_accept() -> None:
    field = Settings.model_fields["publish_lookahead_seconds"]
    (bound,) = [m.le for m in field.metadata if isinstance(m, annotated_types.Le)]
    assert timer.longest_seconds() >= bound


@pytest.mark.parametrize(
    ("remaining", "entrance", "bits"),
    [
        (0.001, "relay.timer.50ms", "1"),  # 1 unit
        (1.0, "relay.timer.800ms", "10100"),  # 20 units
        (59.98, "relay.timer.51200ms", "10010110000"),  # 1,200 units
    ],
)
def test_a_delivery_enters_at_its_waits_highest_level_with_headers_from_there_down(
    remaining: float, entrance: str, bits: str
) -> None:
    """The levels above its highest 1-bit would only pass it on: it skips them."""
    got_entrance, headers = timer.route("relay", remaining)
    assert got_entrance == entrance
    expected = {f"relay-timer-{timer.level_ms(j)}ms": b for j, b in enumerate(reversed(bits))}
    assert headers == expected
