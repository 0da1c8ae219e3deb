"""Where the servers are and why one could not be reached, in a few words.

``parse_server_url`` splits a PostgreSQL DSN or an AMQP URL into what may be printed
(hosts, ports, user, database or vhost) and refuses a malformed one in one line; the
``*_cause`` functions say why a connection failed ("connection refused", "unknown host",
"timed out", "login refused"), the same way for the database and the broker. Nothing
here ever prints a URL or a credential.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

import aiormq
import asyncpg

if TYPE_CHECKING:
    from service.settings import Settings

_ENCODE_HINT = "(a user name or password with '@', '/', ':' or '?' must be percent-encoded)"


@dataclass(frozen=True)
class ServerAddress:
    """Where a server URL points, without its credentials: safe to print."""

    hosts: tuple[tuple[str, int], ...]  # (host, port); host "" is the local socket
    user: str
    path: str  # the database name, or the AMQP virtual host

    def where(self) -> str:
        """``host:port`` (several joined by commas), e.g. ``127.0.0.1:5432``."""
        return ",".join(
            f"[{h}]:{p}" if ":" in h else f"{h or 'local socket'}:{p}" for h, p in self.hosts
        )


def parse_server_url(
    url: str, schemes: tuple[str, ...], default_port: int, *, several_hosts: bool
) -> ServerAddress:
    """Split a PostgreSQL DSN or an AMQP URL; ValueError says what is wrong in one line.

    Neither the URL nor any part of it that may be secret is ever quoted in the error.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a URL: expected {schemes[0]}://user@host:{default_port}/...")
    if scheme.lower() not in schemes:
        # What was given is not quoted: whatever sits before "://" might be a secret.
        raise ValueError(f"the scheme must be {' or '.join(s + '://' for s in schemes)}")
    parts = urlsplit(f"{schemes[0]}://{rest}")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    entries = hostlist.split(",")
    if len(entries) > 1 and not several_hosts:
        raise ValueError("give one host:port")
    hosts = []
    for entry in entries:
        if entry.startswith("["):
            host, _, after = entry[1:].partition("]")
            port_text = after.removeprefix(":")
        else:
            host, _, port_text = entry.partition(":")
        if port_text and not (port_text.isascii() and port_text.isdigit()):
            raise ValueError(f"the port is not a number {_ENCODE_HINT}")
        port = int(port_text) if port_text else default_port
        if not 1 <= port <= 65535:
            raise ValueError("the port must be from 1 to 65535")
        hosts.append((host, port))
    user = unquote(userinfo.partition(":")[0]) if at else ""
    return ServerAddress(tuple(hosts), user, unquote(parts.path.removeprefix("/")))


def one_url_per_host(url: str) -> list[str]:
    """Split a URL naming several hosts (``amqp://u:p@h1:5672,h2:5672/vhost``) into one
    URL per host, each with the same scheme, credentials, path and query, in the order
    given. A URL naming one host comes back alone."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    return [
        urlunsplit((parts.scheme, f"{userinfo}{at}{host}", parts.path, parts.query, parts.fragment))
        for host in hostlist.split(",")
    ]


def connect_cause(exc: BaseException, timeout_seconds: float, timeout_setting: str) -> str:
    """Why a TCP connection failed: refused, unknown host, timeout (naming the setting that
    bounds it), TLS, or the OS's reason."""
    if isinstance(exc, TimeoutError):
        return f"timed out: no answer within {timeout_seconds:g} s ({timeout_setting})"
    if isinstance(exc, socket.gaierror):
        return "unknown host (the name does not resolve)"
    if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
        return "connection refused (nothing listens there)"
    if "Connect call failed" in str(exc):  # several addresses tried, each refused
        return "connection refused (nothing listens there)"
    if isinstance(exc, EOFError):  # e.g. asyncio.IncompleteReadError
        return "the server closed the connection without answering (the wrong port?)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({exc.reason or type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"connection failed ({type(exc).__name__})"


def database_where(settings: Settings, cause: str) -> str:
    """``PostgreSQL at host:port, database 'd' (RELAY_DATABASE_URL): <cause>``."""
    address = settings.database_address()
    return (
        f"PostgreSQL at {address.where()}, database '{address.path}' (RELAY_DATABASE_URL): {cause}"
    )


def database_unreachable(exc: BaseException, settings: Settings) -> str:
    """Where the database is and why it could not be used (never the DSN)."""
    return database_where(settings, _database_cause(exc, settings))


def _database_cause(exc: BaseException, settings: Settings) -> str:
    user = settings.database_address().user
    if isinstance(exc, asyncpg.TargetServerAttributeNotMatched):
        return (
            "no host accepts writes (every one answers as a standby or read-only): "
            "a failover under way, or the primary is missing from the list"
        )
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return "no such database (create it, then run `relay migrate`)"
    if isinstance(exc, asyncpg.InvalidPasswordError):
        return f"login refused for user '{user}': wrong password"
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return f"login refused for user '{user}': {exc}"
    if isinstance(exc, asyncpg.PostgresError) and "unsupported startup parameter" in str(exc):
        return (  # PgBouncer: docs/deploy.md, PgBouncer
            f"the server refused the connection: {exc} (PgBouncer: list it in "
            "ignore_startup_parameters)"
        )
    if isinstance(exc, asyncpg.PostgresError):
        return f"the server refused the connection: {exc}"
    return connect_cause(
        exc,
        settings.database_command_timeout_seconds,
        "RELAY_DATABASE_COMMAND_TIMEOUT_SECONDS",
    )


def broker_where(settings: Settings, cause: str) -> str:
    """``RabbitMQ at host:port, vhost 'v' (RELAY_AMQP_URL): <cause>``."""
    address = settings.amqp_address()
    return f"RabbitMQ at {address.where()}, vhost '{address.path}' (RELAY_AMQP_URL): {cause}"


def broker_unreachable(exc: BaseException, settings: Settings) -> str:
    """Where the broker is and why a connection to it could not be opened."""
    return broker_where(settings, _broker_cause(exc, settings))


def _broker_cause(exc: BaseException, settings: Settings) -> str:
    address = settings.amqp_address()
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
        return f"login refused for user '{address.user}' (wrong user name or password)"
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(exc):
        # RabbitMQ answers opening a vhost that does not exist, or that the user has no
        # permission on, by closing the connection (530 NOT_ALLOWED).
        return (
            f"vhost '{address.path}' does not exist, or user '{address.user}' has no "
            "permission on it"
        )
    if isinstance(exc, aiormq.exceptions.ConnectionClosed):
        return f"the broker closed the connection ({exc})"
    if isinstance(exc, aiormq.exceptions.IncompatibleProtocolError):
        return "not an AMQP 0-9-1 server (is it RabbitMQ's port?)"
    timeout = settings.amqp_timeout_seconds
    if isinstance(exc, aiormq.exceptions.AMQPConnectionError) and exc.__cause__ is not None:
        return connect_cause(exc.__cause__, timeout, "RELAY_AMQP_TIMEOUT_SECONDS")
    if isinstance(exc, TimeoutError | OSError):
        return connect_cause(exc, timeout, "RELAY_AMQP_TIMEOUT_SECONDS")
    return f"connection failed ({type(exc).__name__})"


class _TransportErrorFilter(logging.Filter):
    """Drops aiormq's own log line for a failed connect: ``connect`` raises the error
    with a better message, so the line only doubled it (on stderr, as JSON)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("error when creating transport")


_TRANSPORT_FILTER = _TransportErrorFilter()


def quiet_transport_errors() -> None:
    # Installed on first use, not at import (no import-time side effects); idempotent.
    logging.getLogger("aiormq.connection").addFilter(_TRANSPORT_FILTER)


def os_user() -> str:
    """The user this process runs as: asyncpg's default database user."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "postgres"
