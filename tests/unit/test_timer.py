"""The timer ladder's arithmetic: a wait written in base 8 over queues of fixed TTL."""

from __future__ import annotations

import random

import annotated_types
import pytest

from service import timer
from service.settings import Settings


def _waited_ms(headers: dict[str, str]) -> int:
    """The time a message with these headers spends in the ladder: its digit's queue's TTL
    at each level."""
    return sum(
        int(headers.get(f"relay-ladder-{level}", "0")) * timer.level_ms(level)
        for level in range(timer.LEVELS)
    )


def test_each_level_has_a_queue_per_nonzero_digit_named_by_its_ttl() -> None:
    assert [timer.level_ms(j) for j in range(3)] == [50, 400, 3200]
    assert timer.queues("relay")[:3] == [
        "relay.ladder.50ms",
        "relay.ladder.100ms",
        "relay.ladder.150ms",
    ]
    assert timer.queues("relay")[7] == "relay.ladder.400ms"
    assert len(timer.queues("relay")) == len(set(timer.queues("relay"))) == timer.LEVELS * 7
    assert timer.exchanges("relay") == [f"relay.ladder.level{j}" for j in range(timer.LEVELS)]


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
    assert entrance == timer.exchanges("relay")[-1]  # the top level's exchange
    assert len(headers) == timer.LEVELS and set(headers.values()) == {"7"}
    assert _waited_ms(headers) / 1000 == timer.longest_seconds()


def test_the_ladder_holds_the_longest_look_ahead_the_settings_accept() -> None:
    field = Settings.model_fields["publish_lookahead_seconds"]
    (bound,) = [m.le for m in field.metadata if isinstance(m, annotated_types.Le)]
    assert timer.longest_seconds() >= bound


@pytest.mark.parametrize(
    ("remaining", "entrance", "digits"),
    [
        (0.001, "relay.ladder.level0", "1"),  # 1 unit
        (1.0, "relay.ladder.level1", "24"),  # 20 units
        (59.98, "relay.ladder.level3", "2260"),  # 1,200 units
        (74.95, "relay.ladder.level3", "2733"),  # 1,499 units: the default look-ahead
    ],
)
def test_a_delivery_enters_at_its_waits_highest_level_with_headers_from_there_down(
    remaining: float, entrance: str, digits: str
) -> None:
    """The levels above its highest digit would only pass it on: it skips them."""
    got_entrance, headers = timer.route("relay", remaining)
    assert got_entrance == entrance
    expected = {f"relay-ladder-{j}": d for j, d in enumerate(reversed(digits))}
    assert headers == expected


def test_a_wait_visits_at_most_one_queue_per_level() -> None:
    """A dead-lettering (and an x-death entry the consumer decodes) per nonzero digit: a
    wait within the default look-ahead visits at most 4 queues, against up to 10 in
    binary."""
    visits = [sum(d != 0 for d in timer.digits(units)) for units in range(1, 1500)]
    assert max(visits) == 4
    assert max(bin(units).count("1") for units in range(1, 1500)) == 10
