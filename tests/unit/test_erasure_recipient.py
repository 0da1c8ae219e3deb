"""Who `relay erase` erases: the recipient normalised as the entry and the suppression list
compare it, the stored spellings kept, and the pattern of its mentions in free text (the
same pattern PostgreSQL's ``~*`` reads: checked here with Python's ``re``, which reads it
alike)."""

from __future__ import annotations

import re

import pytest

from service import errors
from service.erasure_recipient import Recipient, mention_pattern, parse, spellings_of


@pytest.mark.parametrize(
    ("given", "channel", "address"),
    [
        ("Ann.Lee@Example.COM", "email", "ann.lee@example.com"),
        ("  ann@example.com ", "email", "ann@example.com"),
        ("+14155550123", "sms", "+14155550123"),
        ("+1 (415) 555-0123", "sms", "+14155550123"),
        ("+44 20 7946 0123", "sms", "+442079460123"),
        (
            "HTTPS://Partner.Example:443/Hooks/R?x=1#frag",
            "webhook",
            "https://partner.example/Hooks/R?x=1",
        ),
        ("http://127.0.0.1:8080", "webhook", "http://127.0.0.1:8080/"),
        ("http://[::1]:80/h", "webhook", "http://[::1]/h"),
    ],
)
def test_a_recipient_is_normalised_as_the_ledger_stores_and_compares_it(
    given: str, channel: str, address: str
) -> None:
    assert parse(given) == Recipient(channel, address)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("", "give an e-mail address, a phone number or a URL"),
        ("4155550123", "international form"),  # no country code: which country?
        ("+1 415 555", "not a valid phone number"),
        ("ann@", "not a valid e-mail address"),
        ("ftp://files.example/x", "must be http(s)"),
    ],
)
def test_what_names_no_recipient_is_a_one_line_error_that_does_not_quote_it(
    given: str, says: str
) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        parse(given)
    message = str(raised.value)
    assert says in message and "\n" not in message
    assert not given.strip() or given.strip() not in message


def test_the_address_never_shows_in_a_repr() -> None:
    assert "ann" not in repr(parse("ann@example.com"))


def test_stored_spellings_of_the_same_recipient_are_kept_and_others_dropped() -> None:
    email = parse("ann@example.com")
    stored = ["Ann@Example.com", "ann@example.com", "ann@example.co", "joann@example.com"]
    assert spellings_of(email, stored) == ["Ann@Example.com", "ann@example.com"]
    url = parse("https://partner.example/hooks/r")
    stored = ["HTTPS://PARTNER.example:443/hooks/r", "https://partner.example/hooks/r2"]
    assert spellings_of(url, stored) == [
        "HTTPS://PARTNER.example:443/hooks/r",
        "https://partner.example/hooks/r",
    ]


@pytest.mark.parametrize(
    ("recipient", "text", "mentions"),
    [
        ("ann@example.com", "write to Ann@Example.com today", True),
        ("ann@example.com", "write to ann@example.com.", True),  # end of a sentence
        ("ann@example.com", '{"customer": "ann@example.com"}', True),
        ("ann@example.com", "/events?q=ann%40example.com&x=1", True),
        ("ann@example.com", "/events?q=ann%40example.com", True),
        ("ann@example.com", "joann@example.com", False),
        ("ann@example.com", "ann@example.com.au", False),
        ("ann@example.com", "ann@example.community", False),
        ("+14155550123", "to +14155550123, twice", True),
        ("+14155550123", "to=%2B14155550123", True),
        ("+14155550123", "+141555501234", False),
        ("https://p.example/hooks/ann", "failed: https://p.example/hooks/ann (410)", True),
        ("https://p.example/hooks/ann", "https://p.example/hooks/anne", False),
        ("https://p.example/hooks/ann", "https://p.example/hooks/ann/2", False),
    ],
)
def test_a_mention_is_found_in_any_case_and_form_but_never_inside_another_value(
    recipient: str, text: str, mentions: bool
) -> None:
    who = parse(recipient)
    pattern = mention_pattern(who, spellings_of(who, []))
    assert bool(re.search(pattern, text, re.IGNORECASE)) is mentions
