"""Several broker nodes in RELAY_AMQP_URL and several database hosts in RELAY_DATABASE_URL
(issue 19): the broker URL splits into one URL per node with the same credentials, vhost
and query; nodes are tried in turn from any of them; the quorum queues' replication
argument is sent only when set; a failover DSN must not ask for a standby."""

from __future__ import annotations

import asyncpg
import pytest

from service import brokers, errors, servers, settings


def test_one_url_per_host_keeps_credentials_vhost_and_query() -> None:
    urls = servers.one_url_per_host(
        "amqps://relay:p%40ss@mq1.internal:5671,mq2.internal,[::1]:5673/%2Fprod?heartbeat=5"
    )
    assert urls == [
        "amqps://relay:p%40ss@mq1.internal:5671/%2Fprod?heartbeat=5",
        "amqps://relay:p%40ss@mq2.internal/%2Fprod?heartbeat=5",
        "amqps://relay:p%40ss@[::1]:5673/%2Fprod?heartbeat=5",
    ]
    assert servers.one_url_per_host("amqp://guest:guest@127.0.0.1:5672/") == [
        "amqp://guest:guest@127.0.0.1:5672/"
    ]


@pytest.mark.parametrize(
    ("first", "order"),
    [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (2, ["c", "a", "b"]), (4, ["b", "c", "a"])],
)
def test_nodes_are_tried_in_turn_from_the_first(first: int, order: list[str]) -> None:
    assert brokers.in_turn(["a", "b", "c"], first) == order


def test_a_cluster_url_is_accepted_and_printed_without_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAY_AMQP_URL", "amqp://relay:s3cret@mq1:5672,mq2:5673,mq3/prod")
    address = settings.load().amqp_address()
    assert (address.where(), address.user, address.path) == (
        "mq1:5672,mq2:5673,mq3:5672",
        "relay",
        "prod",
    )


def test_quorum_arguments_carry_the_group_size_only_when_set() -> None:
    extra = {"x-delivery-limit": 20}
    assert brokers.quorum_arguments(0, extra) == {"x-queue-type": "quorum", **extra}
    assert brokers.quorum_arguments(3, extra) == {
        "x-queue-type": "quorum",
        "x-quorum-initial-group-size": 3,
        **extra,
    }


@pytest.mark.parametrize("value", ["-1", "10", "three"])
def test_a_bad_group_size_names_the_setting(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_AMQP_QUORUM_GROUP_SIZE", value)
    with pytest.raises(errors.ConfigError, match=r"^RELAY_AMQP_QUORUM_GROUP_SIZE: "):
        settings.load()


def test_a_multi_host_dsn_for_failover_is_accepted_and_printed_without_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "RELAY_DATABASE_URL",
        "postgresql://relay:s3cret@pg1:5432,pg2:5433/ledger?target_session_attrs=read-write",
    )
    address = settings.load().database_address()
    assert (address.where(), address.user, address.path) == ("pg1:5432,pg2:5433", "relay", "ledger")


@pytest.mark.parametrize("attrs", ["standby", "read-only", "prefer-standby", "nonsense"])
def test_a_dsn_asking_for_a_standby_names_the_setting(
    attrs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "RELAY_DATABASE_URL",
        f"postgresql://relay:s3cret@pg1,pg2/ledger?target_session_attrs={attrs}",
    )
    with pytest.raises(errors.ConfigError) as raised:
        settings.load()
    assert str(raised.value).startswith("RELAY_DATABASE_URL: target_session_attrs must be")
    assert "s3cret" not in str(raised.value)


def test_no_writable_host_and_a_pgbouncer_refusal_are_explained() -> None:
    config = settings.Settings(
        database_url="postgresql://relay:s3cret@pg1:5432,pg2:5432/ledger",  # type: ignore[arg-type]
    )
    standby_only = servers.database_unreachable(
        asyncpg.TargetServerAttributeNotMatched("none of the hosts match"), config
    )
    assert standby_only.startswith("PostgreSQL at pg1:5432,pg2:5432, database 'ledger'")
    assert "no host accepts writes" in standby_only and "s3cret" not in standby_only
    refused = servers.database_unreachable(
        asyncpg.exceptions.ProtocolViolationError(
            "unsupported startup parameter: statement_timeout"
        ),
        config,
    )
    assert "ignore_startup_parameters" in refused
