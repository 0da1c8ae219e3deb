"""The console's door without I/O: operators-file lines hold token hashes (a token or a
weak hash is refused), a token matches only its own line, failed logins block an address
for a growing time, the client address behind proxies, and the keyed destination
reference the SQL computes equals Python's HMAC."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from aiohttp.test_utils import make_mocked_request

from service import errors
from service.ops.console import operators, refs, throttle

TOKEN = "unit-test-token-0123456789abcdefghij"
CHEAP = (2**14, 8, 1)


def test_a_token_matches_only_its_own_line_and_each_line_has_its_own_salt() -> None:
    line = operators.hash_line("alice", TOKEN, CHEAP)
    assert TOKEN not in line and line.startswith("alice:scrypt$n=16384,r=8,p=1$")
    entry = operators.parse(line, "f")["alice"]
    assert entry.matches(TOKEN)
    assert not entry.matches(TOKEN[:-1]) and not entry.matches(TOKEN + "x")
    again = operators.parse(operators.hash_line("alice", TOKEN, CHEAP), "f")["alice"]
    assert again.salt != entry.salt and again.credential != entry.credential


def test_new_tokens_are_long_and_random() -> None:
    tokens = {operators.new_token() for _ in range(50)}
    assert len(tokens) == 50
    assert all(len(t) >= operators.MIN_TOKEN_CHARS for t in tokens)


def test_a_short_token_is_never_hashed_into_a_line() -> None:
    with pytest.raises(errors.ConfigError, match="32\\+ random characters"):
        operators.hash_line("alice", "x" * 31, CHEAP)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f"alice:{TOKEN}", "line 1: not a token hash (operator alice)"),
        ("alice:scrypt$n=1024,r=8,p=1$c2FsdHNhbHRzYWx0c2FsdA$" + "A" * 43, "weaker than scrypt"),
        ("# only a comment\n", "no operator in it"),
        ("<script>:scrypt$n=16384,r=8,p=1$c2FsdHNhbHRzYWx0c2FsdA$" + "A" * 43, "not plain"),
    ],
)
def test_a_line_that_is_not_a_strong_hash_stops_start_up_saying_how_to_make_one(
    text: str, why: str
) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        operators.parse(text, "RELAY_CONSOLE_OPERATORS_FILE")
    message = str(refused.value)
    assert why in message and "\n" not in message
    assert TOKEN not in message
    if "hash" in why:
        assert "relay console-operators add" in message


def test_an_operator_listed_twice_is_refused() -> None:
    line = operators.hash_line("alice", TOKEN, CHEAP)
    with pytest.raises(errors.ConfigError, match="line 2: alice is listed twice"):
        operators.parse(f"{line}\n{line}\n", "f")


def test_operator_names_are_short_and_plain() -> None:
    assert operators.valid_name("alice") and operators.valid_name("on-call 2")
    assert not operators.valid_name("") and not operators.valid_name("<script>")
    assert not operators.valid_name("x" * 65) and not operators.valid_name("a:b")
    assert not operators.valid_name(" alice")


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_five_failures_within_a_minute_block_an_address_for_a_growing_time() -> None:
    clock = Monotonic()
    door = throttle.LoginThrottle(clock)
    for _ in range(4):
        assert door.failed("10.0.0.1") == 0
        clock.now += 10
    assert door.wait_seconds("10.0.0.1") == 0
    assert door.failed("10.0.0.1") == 60  # the fifth within 60 s
    assert door.wait_seconds("10.0.0.1") == 60
    assert door.wait_seconds("10.0.0.2") == 0  # another address is not touched
    clock.now += 61
    assert door.wait_seconds("10.0.0.1") == 0
    blocks = []
    for _ in range(3):
        for _ in range(4):
            door.failed("10.0.0.1")
        blocks.append(door.failed("10.0.0.1"))
        clock.now += blocks[-1] + 1
    assert blocks == [120, 240, 480]
    door.succeeded("10.0.0.1")
    for _ in range(4):
        door.failed("10.0.0.1")
    assert door.failed("10.0.0.1") == 60  # a good login forgot the growth


def test_failures_spread_over_more_than_a_minute_do_not_block() -> None:
    clock = Monotonic()
    door = throttle.LoginThrottle(clock)
    for _ in range(20):
        assert door.failed("10.0.0.1") == 0
        clock.now += 16  # 4 failures per minute
    assert door.wait_seconds("10.0.0.1") == 0


def test_blocks_grow_to_an_hour_at_most_and_a_quiet_day_forgets_them() -> None:
    clock = Monotonic()
    door = throttle.LoginThrottle(clock)
    block = 0.0
    for _ in range(10):
        for _ in range(5):
            block = door.failed("a")
        clock.now += block + 1
    assert block == throttle.MAX_BLOCK_SECONDS
    clock.now += throttle.FORGET_SECONDS + 1
    for _ in range(5):
        block = door.failed("a")
    assert block == throttle.FIRST_BLOCK_SECONDS


def test_the_client_address_is_the_peer_or_what_the_trusted_proxies_appended() -> None:
    request = make_mocked_request(
        "POST", "/login", headers={"X-Forwarded-For": "6.6.6.6, 203.0.113.7, 10.1.0.5"}
    )
    assert throttle.client_address(request, 0) == (request.remote or "unknown")
    assert throttle.client_address(request, 1) == "10.1.0.5"
    assert throttle.client_address(request, 2) == "203.0.113.7"  # not what the client wrote
    alone = make_mocked_request("POST", "/login")
    assert throttle.client_address(alone, 1) == (alone.remote or "unknown")


def test_the_sql_form_of_the_reference_is_rfc_2104_hmac() -> None:
    key = refs.RefKey(bytes(range(32)))
    destination = "https://partner.example/hooks/t0k3n?x=1"
    inner = hashlib.sha256(key.inner + destination.encode()).digest()
    by_rounds = hashlib.sha256(key.outer + inner).hexdigest()[:16]
    expected = hmac.new(key.secret, destination.encode(), hashlib.sha256).hexdigest()[:16]
    assert by_rounds == expected == key.of(destination)
    assert key.of(destination) != hashlib.sha256(destination.encode()).hexdigest()[:16]
    assert refs.RefKey(bytes(32)).of(destination) != key.of(destination)
