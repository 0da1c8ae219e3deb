"""The console's door without I/O: session cookies are signed by the token, expire, and
carry their own CSRF token; the token itself is compared in constant time."""

from __future__ import annotations

from service.ops.console import security

TOKEN = "unit-test-token-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_cookie_names_its_operator_and_carries_a_csrf_token_of_its_own() -> None:
    door = security.Door(TOKEN, open_reads=False)
    first = door.session(door.issue("alice"))
    second = door.session(door.issue("alice"))
    assert first is not None and second is not None
    assert first.name == "alice" and first.csrf and first.csrf != second.csrf


def test_a_tampered_cookie_or_one_signed_by_another_token_is_refused() -> None:
    door = security.Door(TOKEN, open_reads=False)
    cookie = door.issue("alice")
    rest = cookie.split(".", 1)[1]
    assert door.session(f"bWFsbG9yeQ==.{rest}") is None  # "mallory", alice's signature
    assert door.session(cookie[:-1] + ("0" if cookie[-1] != "0" else "1")) is None
    rotated = security.Door(TOKEN + "-rotated", open_reads=False)
    assert rotated.session(cookie) is None
    assert door.session("") is None and door.session("a.b.c") is None
    assert door.session(None) is None


def test_a_session_ends_after_its_lifetime() -> None:
    clock = Clock()
    door = security.Door(TOKEN, open_reads=False, now=clock)
    cookie = door.issue("alice")
    clock.now += security.SESSION_SECONDS - 1
    assert door.session(cookie) is not None
    clock.now += 2
    assert door.session(cookie) is None


def test_only_the_exact_token_opens_the_door() -> None:
    door = security.Door(TOKEN, open_reads=False)
    assert door.token_ok(TOKEN)
    assert not door.token_ok(TOKEN[:-1]) and not door.token_ok(TOKEN + "x")
    assert not door.token_ok("")


def test_operator_names_are_short_and_plain() -> None:
    assert security.valid_name("alice") and security.valid_name("on-call 2")
    assert not security.valid_name("") and not security.valid_name("<script>")
    assert not security.valid_name("x" * 65)
