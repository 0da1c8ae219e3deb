"""The wire message's bounds: what decoding accepts and what it refuses, with the reason
that becomes the dead letter's header (pure: no I/O)."""

from __future__ import annotations

import json

import pytest

from service import messages


def test_the_largest_bigint_id_is_accepted() -> None:
    body = messages.encode(2**63 - 1)
    assert messages.decode(body).delivery_id == 2**63 - 1


def test_an_id_one_past_bigint_is_refused_before_it_reaches_the_database() -> None:
    with pytest.raises(messages.MessageError, match=r"^invalid message: bad field.*delivery_id"):
        messages.decode(b'{"v": 1, "delivery_id": 9223372036854775808}')


@pytest.mark.parametrize("delivery_id", [b"0", b"-1", b"true", b"1.0", b'"7"', b"null", b"NaN"])
def test_an_id_that_is_not_a_positive_integer_is_refused(delivery_id: bytes) -> None:
    with pytest.raises(messages.MessageError, match=r"delivery_id"):
        messages.decode(b'{"v": 1, "delivery_id": ' + delivery_id + b"}")


def test_a_body_at_the_size_bound_is_decoded_and_one_byte_more_is_refused() -> None:
    head = b'{"v": 1, "delivery_id": 5'
    at_bound = head + b" " * (messages.MAX_BODY_BYTES - len(head) - 1) + b"}"
    assert len(at_bound) == messages.MAX_BODY_BYTES
    assert messages.decode(at_bound).delivery_id == 5
    with pytest.raises(messages.MessageError, match=r"^oversized body"):
        messages.decode(at_bound[:-1] + b" }")


def test_a_body_nested_100000_deep_is_refused_by_size_before_parsing() -> None:
    with pytest.raises(messages.MessageError, match=r"^oversized body"):
        messages.decode(b"[" * 100_000 + b"]" * 100_000)


def test_nesting_as_deep_as_the_size_bound_allows_is_refused_not_raised() -> None:
    # Python 3.11's parser overflows (RecursionError) well within the bound; 3.12 and 3.13
    # recurse deeper and reach the end of the input (ValueError). Either way: refused.
    for depth in (1000, messages.MAX_BODY_BYTES):
        body = b"[" * depth
        assert len(body) <= messages.MAX_BODY_BYTES
        with pytest.raises((RecursionError, ValueError)):
            json.loads(body)
        with pytest.raises(messages.MessageError, match=r"^undecodable body"):
            messages.decode(body)


def test_nesting_inside_a_field_within_the_bounds_is_refused_as_a_bad_field() -> None:
    body = b'{"v": 1, "delivery_id": ' + b"[" * 400 + b"]" * 400 + b"}"
    with pytest.raises(messages.MessageError, match=r"bad field\(s\) delivery_id"):
        messages.decode(body)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json at all", "undecodable body"),
        (b"\xff\xfe\x00", "undecodable body"),
        (b"", "undecodable body"),
        (b"[1, 2]", "invalid message: not a JSON object"),
        (b'{"v": 2, "delivery_id": 1}', "unsupported schema version"),
        (b'{"delivery_id": 1}', "unsupported schema version"),
        (b'{"v": 1}', r"invalid message: bad field\(s\) delivery_id"),
        (b'{"v": 1, "delivery_id": 1, "payload": "x"}', r"invalid message: bad field.*payload"),
    ],
)
def test_each_bad_body_is_refused_with_a_short_reason(body: bytes, reason: str) -> None:
    with pytest.raises(messages.MessageError, match=f"^{reason}"):
        messages.decode(body)


def test_every_refusal_reason_fits_a_header() -> None:
    bodies = [b"x" * 5000, b"[" * 1000, b'{"v": "' + b"9" * 900 + b'"}']
    for body in bodies:
        with pytest.raises(messages.MessageError) as caught:
            messages.decode(body)
        assert len(str(caught.value)) < 100


def test_encode_and_decode_round_trip() -> None:
    assert messages.decode(messages.encode(42)) == messages.DeliveryMessage(v=1, delivery_id=42)
