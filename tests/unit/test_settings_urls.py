"""RELAY_DATABASE_URL and RELAY_AMQP_URL are checked when settings load: a URL the drivers
cannot use is a one-line configuration error naming the setting, never quoting a secret;
a good one says where it points (host:port, user, database or vhost) without its password."""

from __future__ import annotations

import pytest

from service import errors, settings


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://u:s3cret@127.0.0.1:notaport/db", "the port is not a number"),
        ("postgresql://u:s3cret@127.0.0.1:70000/db", "the port must be from 1 to 65535"),
        ("postgresql://u:s3/cret@127.0.0.1/db", "the port is not a number"),
        ("mysql://u:s3cret@127.0.0.1/db", "the scheme must be postgresql:// or postgres://"),
        ("s3cret", "not a URL"),
        ("s3cret://u@h/db", "the scheme must be"),
    ],
)
def test_bad_database_url_names_the_setting_and_never_quotes_a_secret(
    url: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", url)
    with pytest.raises(errors.ConfigError) as raised:
        settings.load()
    message = str(raised.value)
    assert message.startswith(f"RELAY_DATABASE_URL: {problem}")
    assert "s3cret" not in message and "\n" not in message


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("amqp://guest:s3cret@127.0.0.1:x/", "the port is not a number"),
        ("http://guest:s3cret@127.0.0.1/", "the scheme must be amqp:// or amqps://"),
        ("amqp://guest:s3cret@/", "the host is missing"),
        ("amqp://guest:s3cret@h1:5672/,amqp://guest:s3cret@h2:5672/", "give several nodes"),
        ("amqp://guest:s3cret@h1:5672,/", "the host is missing"),
    ],
)
def test_bad_amqp_url_names_the_setting_and_never_quotes_a_secret(
    url: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAY_AMQP_URL", url)
    with pytest.raises(errors.ConfigError) as raised:
        settings.load()
    assert str(raised.value).startswith(f"RELAY_AMQP_URL: {problem}")
    assert "s3cret" not in str(raised.value)


def test_addresses_say_where_without_credentials() -> None:
    config = settings.Settings(
        database_url="postgresql://relay:pw@db.internal:6432,db2.internal/ledger",  # type: ignore[arg-type]
        amqp_url="amqps://relay:pw@mq.internal/%2Fprod",  # type: ignore[arg-type]
    )
    database = config.database_address()
    assert (database.where(), database.user, database.path) == (
        "db.internal:6432,db2.internal:5432",
        "relay",
        "ledger",
    )
    broker = config.amqp_address()
    assert (broker.where(), broker.user, broker.path) == ("mq.internal:5672", "relay", "/prod")


@pytest.mark.parametrize(
    ("sender", "ok"),
    [("Reminders <r@x.example>", True), ("r@x.example", True), ("Reminders", False)],
)
def test_email_sender_is_an_address_with_an_optional_name(
    sender: str, ok: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAY_EMAIL_SENDER", sender)
    if ok:
        assert settings.load().email_sender == sender
    else:
        with pytest.raises(errors.ConfigError, match="RELAY_EMAIL_SENDER: not an e-mail address"):
            settings.load()
