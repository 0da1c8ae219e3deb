"""Every start-up failure is one line on stderr, with no traceback, naming the setting and
the server (host:port, never the DSN or a password) and the cause, with the documented
exit code: 2 for a bad setting (nothing was tried), 3 for a server that cannot be used.
Each row of issue 14 runs the real CLI in a subprocess against real and throwaway servers.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from service import db, errors, telemetry
from service.settings import Settings
from tests.conftest import AMQP_URL
from tests.support import relay as rs
from tests.support.nodes import free_port

pytestmark = pytest.mark.timeout(90)


def _one_line(result: rs.Result, *expected: str) -> str:
    """The single stderr line, after checking it holds every expected fragment."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("relay: "), line
    assert "Traceback" not in result.stderr
    for fragment in expected:
        assert fragment in line, (fragment, line)
    return line


def _with_database(settings: Settings, name: str) -> str:
    parts = urlsplit(settings.database_url.get_secret_value())
    return urlunsplit(parts._replace(path=f"/{name}"))


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")
    host = parts.hostname or "127.0.0.1"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}{netloc[1]}{host}:{port}"))


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


@pytest.fixture
async def unmigrated_database(settings: Settings) -> AsyncIterator[str]:
    """A database that exists but where `relay migrate` never ran."""
    name = f"relay_t_empty_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield _with_database(settings, name)
    admin = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


# ----------------------------------------------------------------- unparseable settings


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        (
            "DATABASE_URL",
            "postgresql://relay:s3cret@127.0.0.1:notaport/relay",
            "RELAY_DATABASE_URL: the port is not a number",
        ),
        (
            "DATABASE_URL",
            "mysql://relay:s3cret@127.0.0.1:3306/relay",
            "RELAY_DATABASE_URL: the scheme must be postgresql:// or postgres://",
        ),
        ("DATABASE_URL", "s3cret", "RELAY_DATABASE_URL: not a URL"),
        (
            "AMQP_URL",
            "amqp://guest:s3cret@127.0.0.1:notaport/",
            "RELAY_AMQP_URL: the port is not a number",
        ),
        (
            "AMQP_URL",
            "http://guest:s3cret@127.0.0.1:5672/",
            "RELAY_AMQP_URL: the scheme must be amqp:// or amqps://",
        ),
        ("LOG_LEVEL", "LOUD", "RELAY_LOG_LEVEL: must be one of DEBUG"),
    ],
)
async def test_unparseable_url_exits_2_naming_the_setting_without_quoting_it(
    settings: Settings, variable: str, value: str, expected: str
) -> None:
    result = await rs.relay(settings, "status", **{variable: value})
    assert result.code == errors.ExitCode.CONFIG
    line = _one_line(result, "relay: configuration error: ", expected)
    assert "s3cret" not in line


# --------------------------------------------------------------------- the database


async def test_database_port_nothing_listens_on_exits_3_naming_host_port(
    settings: Settings,
) -> None:
    port = free_port()
    url = _with_port(settings.database_url.get_secret_value(), port)
    result = await rs.relay(settings, "status", DATABASE_URL=url)
    assert result.code == errors.ExitCode.UNAVAILABLE
    _one_line(result, f"PostgreSQL at 127.0.0.1:{port}", "RELAY_DATABASE_URL", "connection refused")


async def test_database_host_that_does_not_resolve_exits_3_saying_unknown_host(
    settings: Settings,
) -> None:
    url = "postgresql://postgres@no-such-host.invalid:5432/relay"
    result = await rs.relay(settings, "status", DATABASE_URL=url)
    assert result.code == errors.ExitCode.UNAVAILABLE
    _one_line(result, "PostgreSQL at no-such-host.invalid:5432", "unknown host")


async def test_database_that_never_answers_exits_3_saying_timed_out(
    settings: Settings, silent_port: int
) -> None:
    url = _with_port(settings.database_url.get_secret_value(), silent_port)
    result = await rs.relay(
        settings, "status", DATABASE_URL=url, DATABASE_COMMAND_TIMEOUT_SECONDS="1"
    )
    assert result.code == errors.ExitCode.UNAVAILABLE
    _one_line(
        result,
        f"PostgreSQL at 127.0.0.1:{silent_port}",
        "timed out: no answer within 1 s (RELAY_DATABASE_COMMAND_TIMEOUT_SECONDS)",
    )


async def test_database_that_does_not_exist_exits_3_naming_it(settings: Settings) -> None:
    name = f"relay_nope_{uuid.uuid4().hex[:8]}"
    result = await rs.relay(settings, "status", DATABASE_URL=_with_database(settings, name))
    assert result.code == errors.ExitCode.UNAVAILABLE
    _one_line(result, f"database '{name}'", "no such database", "run `relay migrate`")


async def test_unknown_database_user_exits_3_saying_the_login_was_refused(
    settings: Settings,
) -> None:
    parts = urlsplit(settings.database_url.get_secret_value())
    url = urlunsplit(parts._replace(netloc=f"nobody_{uuid.uuid4().hex[:6]}:pw@{parts.hostname}"))
    result = await rs.relay(settings, "status", DATABASE_URL=url)
    assert result.code == errors.ExitCode.UNAVAILABLE
    line = _one_line(result, "RELAY_DATABASE_URL", "login refused for user 'nobody_")
    assert ":pw@" not in line


@pytest.mark.parametrize(
    "command",
    [
        ("status",),
        ("reminders", "list"),
        ("reminders", "load", "-"),
        ("publish",),
        ("replay", "--from", "ledger"),
        ("consume",),
        ("consume", "--check"),
    ],
)
async def test_database_never_migrated_exits_3_with_run_relay_migrate(
    settings: Settings, unmigrated_database: str, command: tuple[str, ...]
) -> None:
    result = await rs.relay(settings, *command, DATABASE_URL=unmigrated_database, stdin="")
    assert result.code == errors.ExitCode.UNAVAILABLE, result.stderr
    _one_line(result, "RELAY_DATABASE_URL", "no relay schema", "run `relay migrate`")


async def test_schema_behind_the_code_exits_3_with_run_relay_migrate(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    latest = db.migration_versions()[-1]  # the newest migration the code has
    await pool.execute("DELETE FROM schema_migrations WHERE version = $1", latest)
    behind = await rs.relay(settings, "status")
    assert behind.code == errors.ExitCode.UNAVAILABLE
    _one_line(behind, "schema is behind", f"from {latest}", "run `relay migrate`")
    await pool.execute("INSERT INTO schema_migrations (version) VALUES ($1)", latest)
    assert (await rs.relay(settings, "status")).code == errors.ExitCode.OK


async def test_migrate_itself_runs_on_a_database_without_the_schema(
    settings: Settings, unmigrated_database: str
) -> None:
    migrated = await rs.relay(settings, "migrate", DATABASE_URL=unmigrated_database)
    assert migrated.code == 0, migrated.stderr
    check = await rs.relay(settings, "consume", "--check", DATABASE_URL=unmigrated_database)
    assert check.code == 0, check.stderr
    assert check.stdout.startswith("ok: ")


# ------------------------------------------------------------------------ the broker


def _amqp(user: str = "guest", password: str = "guest", port: int = 5672, vhost: str = "") -> str:
    host = urlsplit(AMQP_URL).hostname or "127.0.0.1"
    return f"amqp://{user}:{password}@{host}:{port}/{vhost}"


async def test_broker_port_nothing_listens_on_exits_3_naming_host_port(
    settings: Settings,
) -> None:
    port = free_port()
    result = await rs.relay(settings, "consume", "--check", AMQP_URL=_amqp(port=port))
    assert result.code == errors.ExitCode.UNAVAILABLE
    _one_line(result, f"RabbitMQ at 127.0.0.1:{port}", "RELAY_AMQP_URL", "connection refused")


async def test_broker_that_never_answers_exits_3_saying_timed_out(
    settings: Settings, silent_port: int
) -> None:
    result = await rs.relay(
        settings, "consume", "--check", AMQP_URL=_amqp(port=silent_port), AMQP_TIMEOUT_SECONDS="1"
    )
    assert result.code == errors.ExitCode.UNAVAILABLE
    _one_line(result, f"RabbitMQ at 127.0.0.1:{silent_port}", "timed out", "RELAY_AMQP_TIMEOUT")


async def test_broker_vhost_that_does_not_exist_exits_3_naming_it(settings: Settings) -> None:
    vhost = f"nope-{uuid.uuid4().hex[:6]}"
    for command in (("consume", "--check"), ("consume",), ("replay",)):
        result = await rs.relay(settings, *command, AMQP_URL=_amqp(vhost=vhost))
        assert result.code == errors.ExitCode.UNAVAILABLE, (command, result.stderr)
        _one_line(result, f"vhost '{vhost}' does not exist", "RELAY_AMQP_URL")


async def test_broker_wrong_password_exits_3_saying_the_login_was_refused(
    settings: Settings,
) -> None:
    result = await rs.relay(settings, "consume", "--check", AMQP_URL=_amqp(password="wr0ng"))
    assert result.code == errors.ExitCode.UNAVAILABLE
    line = _one_line(result, "login refused for user 'guest'", "RELAY_AMQP_URL")
    assert "wr0ng" not in line


# ---------------------------------------------------------------- relay consume itself


async def test_health_port_in_use_exits_2_naming_relay_health_port(settings: Settings) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        result = await rs.relay(settings, "consume", HEALTH_HOST="127.0.0.1", HEALTH_PORT=str(port))
    assert result.code == errors.ExitCode.CONFIG
    _one_line(result, f"RELAY_HEALTH_PORT: cannot listen on 127.0.0.1:{port}", "already in use")


async def test_health_port_taken_after_the_early_check_is_the_same_config_error(
    settings: Settings,
) -> None:
    """The race the early check cannot close: the port is taken when the endpoint binds.
    The consumer closes what it opened and raises the same one-line error."""
    from consumer import run as consume_run

    telem = telemetry.setup("relay-test", [], environ={})
    try:
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen(1)
            taken = settings.model_copy(
                update={"health_host": "127.0.0.1", "health_port": held.getsockname()[1]}
            )
            with pytest.raises(errors.ConfigError, match="RELAY_HEALTH_PORT: cannot listen"):
                await asyncio.wait_for(
                    consume_run.run(taken, metrics=telem.metrics, stop=asyncio.Event()), 30
                )
    finally:
        telem.shutdown()


@pytest.mark.parametrize("command", [("consume", "--check"), ("consume",)])
@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"WEBHOOK_SIGNING_SECRETS": "whsec_!!!not-base64"}, "RELAY_WEBHOOK_SIGNING_SECRETS"),
        ({"ALLOW_NETWORKS": "10.0.0.1/8"}, "RELAY_ALLOW_NETWORKS: invalid network"),
        ({"EMAIL_API_KEY": "re_123", "EMAIL_SENDER": ""}, "RELAY_EMAIL_SENDER"),
        ({"SMS_ACCOUNT_SID": "AC" + "0" * 32}, "RELAY_SMS_AUTH_TOKEN"),
        ({"BUDGETS": "webhook=0"}, "RELAY_BUDGETS"),
        ({"MAX_ATTEMPTS_PER_CHANNEL": "sms=0"}, "RELAY_MAX_ATTEMPTS_PER_CHANNEL"),
    ],
)
async def test_consume_check_refuses_what_consume_refuses(
    settings: Settings, command: tuple[str, ...], variables: dict[str, str], expected: str
) -> None:
    result = await rs.relay(settings, *command, **variables)
    assert result.code == errors.ExitCode.CONFIG
    line = _one_line(result, "relay: configuration error: ", expected)
    assert "re_123" not in line


async def test_consume_check_on_a_healthy_setup_says_ok(settings: Settings) -> None:
    result = await rs.relay(settings, "consume", "--check")
    assert result.code == 0, result.stderr
    assert result.stdout.strip() == (
        "ok: settings valid, database schema up to date, database and broker reachable"
    )
    assert result.stderr == ""


# ---------------------------------------------------------------------------- a bug


async def _crashing_relay(settings: Settings, **env: str) -> rs.Result:
    """`relay pause` whose handler has a bug, run like the console script."""
    code = (
        "import sys; from service.ops import cli, handlers; from tests.support import crashing; "
        "handlers.HANDLERS['pause'] = crashing.handler; "
        "sys.exit(cli.main(['pause']))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code,
        env=rs.env_for(settings, **env), cwd=rs.REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return rs.Result(proc.returncode, out.decode(), err.decode())


async def test_a_bug_is_one_line_pointing_to_it_and_its_traceback_is_at_debug(
    settings: Settings,
) -> None:
    result = await _crashing_relay(settings)
    assert result.code == errors.ExitCode.BUG == 70  # not 1: that is "incomplete"
    line = _one_line(
        result,
        "relay: internal error (a bug): ValueError: day is out of range for month",
        "at tests/support/crashing.py:",
        "RELAY_LOG_LEVEL=DEBUG prints the traceback",
    )
    assert "customer@example.com" not in line

    debug = await _crashing_relay(settings, LOG_LEVEL="DEBUG")
    assert debug.code == errors.ExitCode.BUG
    assert "Traceback" in debug.stderr and '"event": "internal_error"' in debug.stderr


async def test_version_prints_the_package_version(settings: Settings) -> None:
    result = await rs.relay(settings, "--version")
    assert result.code == 0
    assert result.stdout.startswith("relay 0.")
