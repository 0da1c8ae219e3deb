"""The destinations registry's pure parts: URL normalisation, secrets and their vault, the
grace's duration, the event envelope."""

from __future__ import annotations

import argparse
import base64
from datetime import UTC, datetime, timedelta, timezone

import pytest
from cryptography.fernet import Fernet

from consumer.channels.base import SendRequest
from consumer.channels.webhook import envelope_of
from service import destinations
from service.ops.destinations import parse_duration


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("HTTPS://Partner.Example/hooks/r", "https://partner.example/hooks/r"),
        ("https://partner.example:443/hooks/r", "https://partner.example/hooks/r"),
        ("http://partner.example:80", "http://partner.example/"),
        ("http://partner.example:8080/a?b=1#frag", "http://partner.example:8080/a?b=1"),
        ("https://partner.example/Hooks/R?X=Y", "https://partner.example/Hooks/R?X=Y"),
        ("http://[::1]:8080/x", "http://[::1]:8080/x"),
        ("  https://partner.example/r  ", "https://partner.example/r"),
    ],
)
def test_urls_are_normalised_scheme_host_and_port_only(given: str, normal: str) -> None:
    assert destinations.normalise(given) == normal
    assert destinations.normalise(normal) == normal  # idempotent


def test_a_new_secret_is_a_standard_webhooks_secret_of_32_random_bytes() -> None:
    one, two = destinations.new_secret(), destinations.new_secret()
    assert one != two
    assert one.startswith("whsec_")
    assert len(base64.b64decode(one.removeprefix("whsec_"))) == 32


def test_the_vault_round_trips_and_rekeys_with_the_first_key() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    secret = destinations.new_secret()
    token = destinations.Vault([old]).encrypt(secret)
    assert secret not in token
    both = destinations.Vault([new, old])
    assert both.decrypt(token) == secret
    rekeyed = both.rekey(token)
    assert destinations.Vault([new]).decrypt(rekeyed) == secret
    with pytest.raises(ValueError, match="cannot be decrypted") as raised:
        destinations.Vault([new]).decrypt(token)
    assert secret not in str(raised.value) and token not in str(raised.value)
    assert old not in repr(both) and new not in repr(both)


def test_no_keys_means_no_vault() -> None:
    assert destinations.vault_from_keys([]) is None


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("24h", 86400), ("7d", 604800),
                          ("0.5s", 0.5), ("0", 0)]
)  # fmt: skip
def test_a_grace_is_a_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1w", "-5m", "PT1H", "5 m x"])
def test_a_bad_grace_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_the_envelope_carries_the_type_the_occurrence_in_utc_and_the_payload() -> None:
    at = datetime(2030, 1, 2, 7, 0, tzinfo=timezone(timedelta(hours=1)))
    request = SendRequest(
        delivery_id=1, idempotency_key="k", destination="https://p.example/", attempt=1,
        payload={"site": "north"}, occurrence_at=at, envelope=True, event_type="report.daily",
        signing_secrets=("whsec_c2VjcmV0",),
    )  # fmt: skip
    assert envelope_of(request) == {
        "type": "report.daily",
        "timestamp": "2030-01-02T06:00:00.000000Z",
        "data": {"site": "north"},
    }
    assert "whsec_" not in repr(request)
    assert datetime.fromisoformat(envelope_of(request)["timestamp"]) == at.astimezone(UTC)  # type: ignore[arg-type]
