"""Settings for every relay process, read from the environment (prefix ``RELAY_``).

Each field documents its default and unit. ``load()`` turns a validation failure into
``ConfigError`` with one line naming the setting; the CLI prints it and exits 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict, SettingsError

from service import (
    budget_settings,
    channel_settings,
    console_settings,
    errors,
    receipt_settings,
    recovery_settings,
    retention_settings,
    servers,
)

_ATTEMPTS = re.compile(r"^(\s*[a-z]+=\d+\s*(,\s*[a-z]+=\d+\s*)*)?$")


class Settings(
    budget_settings.BudgetSettings,
    channel_settings.ChannelSettings,
    console_settings.ConsoleSettings,
    receipt_settings.ReceiptSettings,
    recovery_settings.RecoverySettings,
    retention_settings.RetentionSettings,
):
    """All configuration. Environment variable = ``RELAY_`` + upper-cased field name."""

    model_config = SettingsConfigDict(
        env_prefix="RELAY_",
        extra="ignore",
        frozen=True,
        secrets_dir=None,
    )

    # --- connections -------------------------------------------------------------
    database_url: SecretStr = Field(
        default=SecretStr("postgresql://postgres@127.0.0.1:5432/postgres"),
        description="PostgreSQL DSN (asyncpg). May carry credentials, so it is never logged. "
        "Several hosts for failover: postgresql://user@h1:5432,h2:5432/db; a connection "
        "goes to the one that accepts writes (target_session_attrs=read-write by default).",
    )
    database_ssl: str = Field(
        default="prefer",
        description="PostgreSQL TLS mode: disable, prefer, require, verify-ca, verify-full.",
    )
    database_ssl_root_cert: Path | None = Field(
        default=None,
        description="CA file that signed the database's certificate (verify-ca/verify-full); "
        "default: the system's CA store.",
    )
    database_pool_size: int = Field(
        default=10, ge=1, le=200, description="Connections in each process's pool."
    )
    database_statement_cache_size: int = Field(
        default=100,
        ge=0,
        le=10_000,
        description="Prepared statements asyncpg keeps per connection. 0 behind PgBouncer "
        "in transaction pooling unless it is 1.21 or newer with max_prepared_statements set.",
    )
    database_command_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Deadline of every database statement and of taking a pooled "
        "connection (s); a database that stops answering is noticed within it.",
    )
    database_outage_max_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long a consumer waits out an unreachable database, holding its "
        "messages without counting attempts, before it exits with code 3 (s).",
    )
    amqp_url: SecretStr = Field(
        default=SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="RabbitMQ URL (use amqps:// for TLS). Never logged. A cluster's nodes "
        "as comma-separated hosts in one URL, amqp://user:password@host1:5672,host2:5672/vhost: "
        "a connection tries them in turn, from a random one.",
    )
    amqp_namespace: str = Field(
        default="relay",
        pattern=r"^[a-z][a-z0-9_-]{0,40}$",
        description="Prefix of every exchange and queue name (relay.work, relay.deliveries, ...).",
    )
    amqp_heartbeat_seconds: int = Field(
        default=8,
        ge=1,
        le=600,
        description="AMQP heartbeat (s): a broker that stops answering is noticed within "
        "3 x (this + 1) s (27 s at 8).",
    )
    amqp_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Deadline of one broker operation: connect, open a channel, declare, "
        "consume, cancel, close (s).",
    )
    amqp_quorum_group_size: int = Field(
        default=0,
        ge=0,
        le=9,
        description="x-quorum-initial-group-size of the quorum queues: how many nodes hold a "
        "replica of each queue the relay creates (3 on a 3-node cluster). 0: not sent, the "
        "broker's default. Only a new queue takes it; an existing one keeps its members.",
    )
    broker_outage_max_seconds: float = Field(
        default=300.0,
        gt=0,
        description="How long a consumer that lost the broker keeps reconnecting (backoff "
        "0.5 s doubling to 30 s, jittered) before it exits with code 3 (s).",
    )
    amqp_delivery_limit: int = Field(
        default=20,
        ge=1,
        description="x-delivery-limit on the work queues: redeliveries before the broker "
        "dead-letters a message that keeps crashing consumers (poison guard).",
    )

    # --- publisher ---------------------------------------------------------------
    publish_batch_size: int = Field(
        default=500, ge=1, le=10_000, description="Reminders locked per admission transaction."
    )
    publish_max_in_flight: int = Field(
        default=1000, ge=1, le=20_000, description="Unconfirmed publishes allowed at once."
    )
    publish_timer_max_in_flight: int = Field(
        default=200,
        ge=1,
        le=20_000,
        description="Of those, into the timer ladder: a wait starts when the broker takes the "
        "message, so a deep intake makes look-ahead deliveries late; a shallow one publishes "
        "more slowly.",
    )
    publish_confirm_timeout_seconds: float = Field(
        default=15.0, gt=0, description="How long to wait for one publisher confirm (s)."
    )
    publish_lookahead_seconds: float = Field(
        default=75.0,
        ge=0,
        le=3600,
        description="A publish run also admits occurrences due this far ahead and hands "
        "them to the broker's timer ladder, so each becomes deliverable at its due time "
        "(s). Sized for a minutely CronJob plus its start-up; 0: admit only what is due.",
    )
    misfire_grace_seconds: float = Field(
        default=300.0,
        ge=0,
        description="An occurrence older than this when discovered counts as missed (s).",
    )
    catch_up_limit: int = Field(
        default=24, ge=1, description="Most missed occurrences one reminder may catch up."
    )

    # --- consumer ----------------------------------------------------------------
    prefetch: int = Field(
        default=200,
        ge=1,
        le=5000,
        description="Unacked messages per consumer (deliveries in flight).",
    )
    lease_seconds: float = Field(
        default=120.0,
        gt=0,
        description="How long a claim holds a row in 'sending' before another may take it "
        "(s). Must exceed RELAY_HTTP_TIMEOUT_SECONDS; a send left with less lease than that "
        "after waiting for budget is deferred instead.",
    )
    shutdown_grace_seconds: float = Field(
        default=20.0,
        gt=0,
        description="On SIGTERM, time to finish in-flight deliveries before closing (s). "
        "Keep it below the pod's terminationGracePeriodSeconds.",
    )
    http_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Total time for one provider request (s)."
    )
    http_connect_timeout_seconds: float = Field(
        default=3.0, gt=0, description="Time to open a connection to a provider (s)."
    )
    write_batch_max: int = Field(
        default=200, ge=1, le=5000, description="Most claims/outcomes grouped in one transaction."
    )
    write_batch_linger_seconds: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="How long a claim or an outcome write that is not part of a full batch "
        "waits for others to share its statement (s); 0: never waits.",
    )
    liveness_stall_seconds: float = Field(
        default=120.0,
        gt=0,
        description="/livez fails when the consumer holds messages and has finished none "
        "for this long (s), so a hang gets the pod restarted.",
    )
    metrics_sample_seconds: float = Field(
        default=15.0, gt=0, description="How often the consumer refreshes its gauges (s)."
    )
    health_host: str = Field(default="0.0.0.0", description="Address of the health endpoint.")
    health_port: int = Field(
        default=8081, ge=0, le=65535, description="Port of /livez, /readyz, /metrics (0: off)."
    )

    # --- retries ------------------------------------------------------------------
    retry_base_seconds: float = Field(
        default=30.0, gt=0, description="First retry delay before jitter (s)."
    )
    retry_multiplier: float = Field(
        default=4.0, ge=1, description="Growth of the retry delay per attempt."
    )
    retry_max_seconds: float = Field(
        default=6 * 3600.0, gt=0, description="Cap on one retry delay (s)."
    )
    retry_after_max_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Longest Retry-After honoured; longer ones are capped (s).",
    )
    max_attempts: int = Field(
        default=8, ge=1, le=100, description="Attempts per delivery before it is dead."
    )
    max_attempts_per_channel: str = Field(
        default="",
        description="Per-channel attempt budgets overriding max_attempts, e.g. 'sms=4,email=10'.",
    )
    delay_tiers_seconds: Annotated[list[float], NoDecode] = Field(
        default=[1, 5, 30, 120, 600, 3600],
        description="Delay-queue TTLs (s), comma-separated. A delay hops through the "
        "largest tier not longer than what remains.",
    )

    # --- operators ------------------------------------------------------------------
    run_hold_recheck_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A message for a row of a held run (`relay runs hold`) is parked this "
        "long, without an attempt, before it looks again (s).",
    )

    crash_at: str = Field(
        default="",
        description="Testing only: SIGKILL the process at these named points "
        "(after_send, after_write, after_publish, purge_after_batch, purge_inside_batch, "
        "publish_after_admit).",
    )

    # --- demo / paths -------------------------------------------------------------
    state_dir: Path = Field(
        default=Path("var"), description="Where the demo writes logs and scratch files."
    )

    @field_validator("delay_tiers_seconds", mode="before")
    @classmethod
    def _split_tiers(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("delay_tiers_seconds")
    @classmethod
    def _tiers_valid(cls, value: list[float]) -> list[float]:
        if not value or any(t <= 0 for t in value):
            raise ValueError("needs one or more positive numbers of seconds")
        return sorted(set(value))

    @model_validator(mode="after")
    def _lease_outlasts_a_send(self) -> Settings:
        # A claim must outlive the request it guards, or a second consumer could take
        # the row while the first is still sending.
        if self.lease_seconds <= self.http_timeout_seconds:
            raise ValueError(
                f"RELAY_LEASE_SECONDS ({self.lease_seconds}) must exceed "
                f"RELAY_HTTP_TIMEOUT_SECONDS ({self.http_timeout_seconds})"
            )
        return self

    @field_validator("max_attempts_per_channel")
    @classmethod
    def _attempts_syntax(cls, value: str) -> str:
        if not _ATTEMPTS.match(value):
            raise ValueError("expected channel=attempts,... e.g. sms=4,email=10")
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url_parses(cls, value: SecretStr) -> SecretStr:
        dsn = value.get_secret_value()
        servers.parse_server_url(dsn, ("postgresql", "postgres"), 5432, several_hosts=True)
        attrs = parse_qs(urlsplit(dsn).query).get("target_session_attrs", ["read-write"])
        if attrs[-1] not in ("read-write", "primary", "any"):
            raise ValueError(
                "target_session_attrs must be read-write (the default), primary or any"
            )
        return value

    @field_validator("amqp_url")
    @classmethod
    def _amqp_url_parses(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if "://" in url.partition("://")[2]:
            raise ValueError(
                "give several nodes as hosts of one URL: "
                "amqp://user:password@host1:5672,host2:5672/vhost"
            )
        address = servers.parse_server_url(url, ("amqp", "amqps"), 5672, several_hosts=True)
        if not all(host for host, _ in address.hosts):
            raise ValueError("the host is missing (expected amqp://user:password@host:5672/)")
        return value

    def database_address(self) -> servers.ServerAddress:
        """Where RELAY_DATABASE_URL points (host:port, user, database): safe to print."""
        url, schemes = self.database_url.get_secret_value(), ("postgresql", "postgres")
        address = servers.parse_server_url(url, schemes, 5432, several_hosts=True)
        # asyncpg's defaults: the database is named like the user, the user like the OS user.
        user = address.user or os.environ.get("PGUSER") or servers.os_user()
        return servers.ServerAddress(address.hosts, user, address.path or user)

    def amqp_address(self) -> servers.ServerAddress:
        """Where RELAY_AMQP_URL points (host:port, user, virtual host): safe to print."""
        address = servers.parse_server_url(
            self.amqp_url.get_secret_value(), ("amqp", "amqps"), 5672, several_hosts=True
        )
        return servers.ServerAddress(address.hosts, address.user or "guest", address.path or "/")

    @field_validator("database_ssl")
    @classmethod
    def _ssl_mode(cls, value: str) -> str:
        modes = {"disable", "prefer", "require", "verify-ca", "verify-full", "allow"}
        if value not in modes:
            raise ValueError(f"must be one of {', '.join(sorted(modes))}")
        return value


def load(**overrides: object) -> Settings:
    """Read settings from the environment; raise ConfigError naming the bad setting.

    With ``RELAY_SECRETS_DIR`` set (e.g. a mounted Kubernetes Secret), a file in that
    directory named like a variable (``RELAY_DATABASE_URL``) supplies its value when
    the environment does not.
    """
    secrets_dir = os.environ.get("RELAY_SECRETS_DIR")
    if secrets_dir is not None and not Path(secrets_dir).is_dir():
        raise errors.ConfigError(f"RELAY_SECRETS_DIR: not a directory: {secrets_dir}")
    try:
        if secrets_dir:
            return Settings(_secrets_dir=secrets_dir, **overrides)  # type: ignore[call-arg,arg-type]
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a rule across settings: its message names them
            raise errors.ConfigError(first["msg"].removeprefix("Value error, ")) from None
        field = str(first["loc"][0])
        message = first["msg"].removeprefix("Value error, ")
        raise errors.ConfigError(f"RELAY_{field.upper()}: {message}") from None
    except SettingsError as exc:
        raise errors.ConfigError(str(exc)) from None
