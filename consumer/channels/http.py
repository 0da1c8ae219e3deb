"""Shared plumbing for the HTTP channel adapters (webhook, email, SMS).

Owns the parts every HTTP adapter must do the same way: the one lazily created
session per adapter (no cookies, no environment proxies unless asked, an optional
resolver such as the webhook's address policy), one POST that never follows a
redirect and reads the body within a byte budget, the config checks every adapter
shares, the idempotency-key check, classifying a status code into an ``Outcome``, and
mapping transport exceptions (timeouts, refused connections) to retryable outcomes.
Reading an answer's text (Retry-After, a log-safe excerpt, a JSON body, a provider's
token) is in ``consumer.channels.text``, re-exported here for the adapters.

Provider specifics (request shape, signing, receipts, error names) stay in the
adapters. Nothing here logs, and nothing here ever sees a secret.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver
from pydantic import SecretStr

from consumer.channels.base import Outcome, OutcomeKind

# Re-exported: the adapters call them through this module (``http.excerpt(...)``).
from consumer.channels.text import excerpt, parse_retry_after, safe_token, try_json_object
from service.netpolicy import url_problem

__all__ = [
    "TRANSPORT_ERRORS",
    "BoundedBody",
    "HttpConfig",
    "HttpReply",
    "ProviderConfig",
    "SharedSession",
    "check_http_config",
    "check_positive",
    "check_provider_config",
    "classify_status",
    "excerpt",
    "get_bounded",
    "parse_retry_after",
    "post_bounded",
    "read_bounded",
    "rejected",
    "rejected_key",
    "safe_token",
    "secret_value",
    "transport_outcome",
    "try_json_object",
]


@dataclass(frozen=True)
class BoundedBody:
    """At most ``limit`` bytes of a response body and how the read ended."""

    data: bytes
    truncated: bool  # the body had more than the limit; the rest was not read
    complete: bool  # False if the read failed part way (timeout, disconnect)


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> BoundedBody:
    """Read at most ``limit`` bytes of the body, never more.

    Reading stops at the limit (one extra byte tells us whether there was more),
    so a huge or endless body cannot exhaust memory. A transport failure while
    reading the body does not raise: the status line has already arrived and
    decides the outcome, so we keep what we have.
    """
    chunks: list[bytes] = []
    total = 0
    complete = True
    try:
        while total <= limit:
            chunk = await response.content.read(limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except (TimeoutError, aiohttp.ClientError):
        complete = False
    data = b"".join(chunks)
    return BoundedBody(data=data[:limit], truncated=len(data) > limit, complete=complete)


def classify_status(
    status: int,
    headers: Mapping[str, str],
    *,
    now: datetime,
    response_excerpt: str | None = None,
    detail: str | None = None,
    gone_disables: bool = False,
) -> Outcome:
    """Classify a non-2xx status the same way for every HTTP adapter.

    ``detail`` (e.g. ``"resend validation_error"``, ``"twilio 21211"``)
    replaces the generic ``"http 400"`` error text; it must already be
    log-safe. The status is always in ``Outcome.http_status``.
    ``gone_disables`` makes 410 disable the destination: right for a partner
    URL, wrong for a provider API endpoint whose 410 says nothing about the
    recipient.
    """
    error = f"http {status}" if detail is None else detail
    retry_after = parse_retry_after(headers.get("Retry-After"), now)

    def outcome(kind: OutcomeKind, err: str, **kw: Any) -> Outcome:
        return Outcome(
            kind=kind,
            http_status=status,
            error=err,
            response_excerpt=response_excerpt,
            **kw,
        )

    if 300 <= status < 400:
        # Following would hand the destination choice to the remote side
        # (and the Location header could name an internal address).
        return outcome(OutcomeKind.REJECTED, "redirect not followed")
    if status == 429:
        return outcome(OutcomeKind.THROTTLED, error, retry_after_seconds=retry_after)
    if status in (408, 425) or 500 <= status < 600:
        return outcome(OutcomeKind.RETRY, error, retry_after_seconds=retry_after)
    if status == 410 and gone_disables:
        return outcome(
            OutcomeKind.REJECTED, "410 gone: destination disabled", disable_destination=True
        )
    if 400 <= status < 500:
        return outcome(OutcomeKind.REJECTED, error)
    # 1xx leaking through or a non-standard code: we cannot tell whether the
    # request was processed, so retry with the same key rather than drop it.
    return outcome(OutcomeKind.RETRY, f"http {status}: unexpected status")


def transport_outcome(exc: BaseException) -> Outcome:
    """Map a transport failure to a RETRY outcome.

    ``possibly_delivered`` is False only when the failure happened before any
    byte of the request could reach the server (connect failures, DNS);
    otherwise the provider may have acted on it, and the retry reuses the key.
    The error text is a fixed phrase, never the exception message (aiohttp puts
    the URL and host into those).
    """
    connect_phase = isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        error = "dns error"
    elif isinstance(exc, aiohttp.ConnectionTimeoutError):
        error = "connect timeout"
    elif isinstance(exc, TimeoutError):
        error = "timeout"
    else:
        error = "connection error"
    return Outcome(kind=OutcomeKind.RETRY, error=error, possibly_delivered=not connect_phase)


@dataclass(frozen=True)
class HttpReply:
    """Status, headers and the bounded body of one answered request."""

    status: int
    headers: Mapping[str, str]
    body: BoundedBody


# What ``post_bounded`` raises when the transport fails; map it with ``transport_outcome``.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, OSError)


async def post_bounded(
    session: aiohttp.ClientSession,
    url: str | yarl.URL,
    *,
    max_response_bytes: int,
    **kwargs: Any,
) -> HttpReply:
    """POST once without following redirects and read a bounded body.

    Transport failures raise (``TRANSPORT_ERRORS``); the caller maps them with
    ``transport_outcome``. Leaving before the body's end closes the connection,
    so an unread remainder is never drained.
    """
    async with session.post(url, allow_redirects=False, **kwargs) as response:
        body = await read_bounded(response, max_response_bytes)
        return HttpReply(status=response.status, headers=response.headers, body=body)


async def get_bounded(
    session: aiohttp.ClientSession,
    url: str | yarl.URL,
    *,
    max_response_bytes: int,
    **kwargs: Any,
) -> HttpReply:
    """GET once without following redirects and read a bounded body (as ``post_bounded``)."""
    async with session.get(url, allow_redirects=False, **kwargs) as response:
        body = await read_bounded(response, max_response_bytes)
        return HttpReply(status=response.status, headers=response.headers, body=body)


class SharedSession:
    """The one ClientSession of a channel adapter, created lazily and set up the same
    way for every adapter.

    Created on first use because a session (and a resolver) must be made inside
    the running loop; creation has no await, so concurrent first sends share one
    session. Cookies are never kept (one destination must not see another's).
    Environment proxies are ignored unless ``trust_env``: a proxy connects on our
    behalf and would bypass a resolver's address check.

    ``resolver`` builds the DNS resolver the connector asks before every fresh
    connection (the webhook's address policy); the session owns and closes what it
    builds. ``connection_limit_per_host`` defaults to ``connection_limit``;
    ``dns_cache_ttl_seconds=None`` turns aiohttp's DNS cache off, so every new
    connection resolves (and is checked) again.
    """

    def __init__(
        self,
        *,
        channel: str,
        timeout_seconds: float,
        connect_timeout_seconds: float,
        connection_limit: int,
        connection_limit_per_host: int | None = None,
        trust_env: bool = False,
        resolver: Callable[[], AbstractResolver] | None = None,
        dns_cache_ttl_seconds: int | None = 10,
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        self._channel = channel
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_seconds, sock_connect=connect_timeout_seconds
        )
        self._limit = connection_limit
        self._limit_per_host = (
            connection_limit if connection_limit_per_host is None else connection_limit_per_host
        )
        self._trust_env = trust_env
        self._make_resolver = resolver
        self._dns_cache_ttl_seconds = dns_cache_ttl_seconds
        self._trace_configs = list(trace_configs)
        self._session: aiohttp.ClientSession | None = None
        self._resolver: AbstractResolver | None = None
        self._closed = False

    def get(self) -> aiohttp.ClientSession:
        """The session, created on the first call; RuntimeError after ``close()``."""
        if self._closed:
            raise RuntimeError(f"{self._channel} channel is closed")
        if self._session is None:
            if self._make_resolver is not None:
                self._resolver = self._make_resolver()
            connector = aiohttp.TCPConnector(
                limit=self._limit,
                limit_per_host=self._limit_per_host,
                resolver=self._resolver,  # None: aiohttp's default, owned by the connector
                use_dns_cache=self._dns_cache_ttl_seconds is not None,
                ttl_dns_cache=self._dns_cache_ttl_seconds,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                trust_env=self._trust_env,
                cookie_jar=aiohttp.DummyCookieJar(),
                trace_configs=self._trace_configs or None,
            )
        return self._session

    async def close(self) -> None:
        """Close the session, then the resolver it built; safe to call twice."""
        self._closed = True
        session, self._session = self._session, None
        resolver, self._resolver = self._resolver, None
        if session is not None:
            await session.close()
        if resolver is not None:
            await resolver.close()


def secret_value(secret: SecretStr | str) -> str:
    """The plain value of a credential given as SecretStr or str."""
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def check_positive(config: object, *names: str) -> None:
    """Raise ValueError unless each named numeric field is finite and > 0."""
    for name in names:
        value = getattr(config, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number")


def rejected(error: str) -> Outcome:
    """A REJECTED outcome made before any request (bad payload, refused destination)."""
    return Outcome(kind=OutcomeKind.REJECTED, error=error, possibly_delivered=False)


# Sent as a header value, so visible ASCII only; Resend caps keys at 256 characters.
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,256}")


def rejected_key(key: str) -> Outcome | None:
    """A REJECTED outcome if ``key`` cannot be sent as an idempotency key, else None."""
    return None if _IDEMPOTENCY_KEY.fullmatch(key) else rejected("invalid idempotency key")


class HttpConfig(Protocol):
    """What every HTTP adapter's config has, read by ``check_http_config``."""

    @property
    def timeout_seconds(self) -> float: ...

    @property
    def connect_timeout_seconds(self) -> float: ...

    @property
    def connection_limit(self) -> int: ...

    @property
    def max_response_bytes(self) -> int: ...

    @property
    def max_response_excerpt_bytes(self) -> int: ...


_POSITIVE = ("timeout_seconds", "connect_timeout_seconds", "max_response_bytes", "connection_limit")


def check_http_config(config: HttpConfig, *also_positive: str) -> None:
    """The checks every HTTP adapter's config shares: timeouts, the response read
    budget and the connection limit (and the named fields) positive, and the
    response excerpt no longer than what is read. Raises ValueError naming the field."""
    check_positive(config, *_POSITIVE, *also_positive)
    if not 0 <= config.max_response_excerpt_bytes <= config.max_response_bytes:
        raise ValueError("max_response_excerpt_bytes must be within 0..max_response_bytes")


class ProviderConfig(HttpConfig, Protocol):
    """What ``check_provider_config`` reads of a provider API adapter's config."""

    @property
    def base_url(self) -> str: ...


def check_provider_config(config: ProviderConfig, *also_positive: str) -> None:
    """``check_http_config`` plus a well-formed ``base_url``, stored without its
    trailing slash."""
    problem = url_problem(config.base_url)
    if problem is not None:
        raise ValueError(f"base_url: {problem}")
    object.__setattr__(config, "base_url", config.base_url.rstrip("/"))
    check_http_config(config, *also_positive)
