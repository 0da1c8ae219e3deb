"""Partner webhook adapter: one signed JSON POST per attempt.

Owns the webhook request shape (JSON body, ``Idempotency-Key`` and Standard
Webhooks ``webhook-id`` / ``webhook-timestamp`` / ``webhook-signature``
headers), destination safety at connect time, and the receipt taken from the
partner's answer. The session, the bounded POST, the config checks and the
classification are the shared plumbing of ``consumer.channels.http``.

Destination safety has two layers, both driven by ``service.netpolicy``:

* before the request: the URL shape, and literal IP hosts (aiohttp never
  passes literal IPs to the resolver, so they must be checked here);
* at connect time: ``PolicyResolver`` checks every address a host name
  resolves to, on every fresh resolution, so a name that was public when the
  reminder was created and later rebinds to 10.0.0.1 is still refused.

Redirects are never followed, proxies from the environment are ignored (a proxy
would connect on our behalf, bypassing the resolver check) and cookies are not
kept (one partner must not see another's cookies): ``http.SharedSession`` and
``http.post_bounded`` do this for every adapter.

Nothing here logs. Outcomes carry fixed reasons, never the payload, the URL,
or a secret.
"""

from __future__ import annotations

import base64
import binascii
import json
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from standardwebhooks.webhooks import Webhook

from consumer.channels import http
from consumer.channels.base import Outcome, OutcomeKind, SendRequest
from service import limits
from service.netpolicy import (
    DestinationRefused,
    IPNetwork,
    check_addresses,
    host_problem,
    url_problem,
)

__all__ = ["PolicyResolver", "WebhookChannel", "WebhookConfig", "envelope_of"]

_SECRET_PREFIX = "whsec_"
# The optional event envelope: {"type", "timestamp", "data"} (Standard Webhooks), and the
# header that names the version of that body's schema.
SCHEMA_VERSION_HEADER = "webhook-schema-version"
ENVELOPE_SCHEMA_VERSION = "1"
# Room for the envelope around a payload: '{"type":"<=100 chars","timestamp":"...","data":}'.
_ENVELOPE_ROOM = 256


def envelope_of(request: SendRequest) -> dict[str, object]:
    """The Standard Webhooks event envelope of a request: its type, the occurrence's time
    (RFC 3339, UTC) and the payload as ``data``."""
    at = request.occurrence_at.astimezone(UTC)
    return {
        "type": request.event_type,
        "timestamp": at.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        "data": request.payload,
    }


def _decode_secret(secret: str) -> bytes:
    raw = secret.removeprefix(_SECRET_PREFIX)
    return base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)


@dataclass(frozen=True, kw_only=True)
class WebhookConfig:
    """Settings for ``WebhookChannel``. Secrets are excluded from repr."""

    # 'whsec_<base64>' secrets. Every secret signs every request, so during a
    # rotation (old, new) partners verifying with either one succeed. Empty
    # means unsigned requests (no webhook-signature header), as the settings allow.
    signing_secrets: tuple[str, ...] = field(default=(), repr=False)
    timeout_seconds: float = 10.0  # whole attempt: connect, send, headers and body read
    connect_timeout_seconds: float = 3.0  # TCP connect (plus TLS) per address
    allow_networks: tuple[IPNetwork, ...] = ()  # exceptions to the SSRF policy
    max_request_bytes: int = limits.WEBHOOK_MAX_BODY_BYTES  # serialized JSON body (as at entry)
    max_response_bytes: int = 64 * 1024  # read at most this much of any answer
    max_response_excerpt_bytes: int = 1024  # kept in Outcome.response_excerpt
    user_agent: str = "reminder-relay-webhooks/1"
    connection_limit: int = 100  # all partners together
    connection_limit_per_host: int = 8  # per (host, port, tls): one slow partner can't hog all
    dns_cache_ttl_seconds: int | None = 10  # None disables aiohttp's DNS cache
    receipt_headers: tuple[str, ...] = ("X-Request-Id", "Request-Id", "X-Message-Id")

    def __post_init__(self) -> None:
        for index, secret in enumerate(self.signing_secrets):
            try:
                decoded = _decode_secret(secret)
            except (binascii.Error, ValueError):
                # Never echo the secret itself.
                raise ValueError(f"signing_secrets[{index}] is not valid base64") from None
            if not decoded:
                raise ValueError(f"signing_secrets[{index}] is empty")
        http.check_http_config(self, "max_request_bytes", "connection_limit_per_host")


class PolicyResolver(AbstractResolver):
    """Wraps a real resolver and refuses answers the address policy forbids.

    aiohttp calls this right before connecting (and again whenever its DNS
    cache entry expires), so the addresses checked are the ones connected to.
    If ANY answer is refused the whole lookup is refused, since the connector
    may try the addresses in any order. ``DestinationRefused`` propagates out
    of ``session.request`` unchanged (it is not an OSError, which aiohttp would
    wrap as a retryable DNS error).
    """

    def __init__(
        self,
        inner: AbstractResolver,
        allow: Sequence[IPNetwork],
        *,
        owns_inner: bool = True,
    ) -> None:
        self._inner = inner
        self._allow = tuple(allow)
        self._owns_inner = owns_inner

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        problem = host_problem(host, self._allow)
        if problem is not None:
            raise DestinationRefused(problem)
        results = await self._inner.resolve(host, port, family)
        check_addresses((result["host"] for result in results), self._allow)
        return results

    async def close(self) -> None:
        if self._owns_inner:
            await self._inner.close()


def _refusal(exc: BaseException) -> DestinationRefused | None:
    """Find a policy refusal that some aiohttp version may have wrapped."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, DestinationRefused):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class WebhookChannel:
    """Channel adapter for partner webhooks, sharing one ClientSession.

    The session is created lazily on the first ``send`` (it needs a running
    loop); ``close()`` releases it. ``resolver`` replaces the inner DNS
    resolver (default: aiohttp's DefaultResolver) and is mainly for tests; it is
    always wrapped by the policy. ``trace_configs`` are passed to the session
    (tracing/metrics hooks).
    """

    name: str = "webhook"

    def __init__(
        self,
        config: WebhookConfig,
        *,
        resolver: AbstractResolver | None = None,
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        self._config = config
        self._signers = tuple(Webhook(secret) for secret in config.signing_secrets)
        self._own_signers: dict[str, Webhook] = {}  # a destination's secret -> its signer
        self._inner_resolver = resolver
        self._session = http.SharedSession(
            channel=self.name,
            timeout_seconds=config.timeout_seconds,
            connect_timeout_seconds=config.connect_timeout_seconds,
            connection_limit=config.connection_limit,
            connection_limit_per_host=config.connection_limit_per_host,
            trust_env=False,  # a proxy would connect for us, past the resolver's check
            resolver=self._policy_resolver,
            dns_cache_ttl_seconds=config.dns_cache_ttl_seconds,
            trace_configs=trace_configs,
        )
        # The static URL check depends only on the string and the config: done once each.
        self._checked: dict[str, tuple[yarl.URL | None, str | None]] = {}

    def _policy_resolver(self) -> PolicyResolver:
        """The connect-time check, built by the session inside the running loop."""
        inner = self._inner_resolver or aiohttp.DefaultResolver()
        return PolicyResolver(
            inner, self._config.allow_networks, owns_inner=self._inner_resolver is None
        )

    def _check_destination(self, destination: str) -> tuple[yarl.URL | None, str | None]:
        problem = url_problem(destination)
        if problem is not None:
            return None, problem
        try:
            # Check the URL exactly as aiohttp will parse it, so a parser
            # difference cannot smuggle a literal private IP past the check.
            url = yarl.URL(destination, encoded=False)
        except (ValueError, TypeError):
            return None, "url: malformed"
        if url.scheme not in ("http", "https") or url.user is not None or not url.raw_host:
            return None, "url: malformed"
        problem = host_problem(url.raw_host, self._config.allow_networks)
        if problem is not None:
            return None, problem
        return url, None

    def _signers_for(self, secrets: tuple[str, ...] | None) -> tuple[Webhook, ...]:
        """The destination's own secrets sign its requests (only they: another partner's
        secret, or the shared one, must not verify them); without any, the configured ones."""
        if secrets is None:
            return self._signers
        signers = []
        for secret in secrets:
            signer = self._own_signers.get(secret)
            if signer is None:
                if len(self._own_signers) >= 10_000:
                    self._own_signers.clear()
                signer = self._own_signers[secret] = Webhook(secret)
            signers.append(signer)
        return tuple(signers)

    def _headers(
        self,
        key: str,
        body: str,
        *,
        stale: bool = False,
        signers: tuple[Webhook, ...] = (),
        envelope: bool = False,
    ) -> dict[str, str]:
        timestamp = int(time.time())
        signed_at = datetime.fromtimestamp(timestamp, UTC)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": self._config.user_agent,
            "Idempotency-Key": key,
            "webhook-id": key,
            "webhook-timestamp": str(timestamp),
        }
        if stale:
            # Sent although older than the reminder's stale_after: the receiver decides.
            headers["X-Relay-Stale"] = "true"
        if envelope:
            headers[SCHEMA_VERSION_HEADER] = ENVELOPE_SCHEMA_VERSION
        if signers:
            # The standardwebhooks library signs f"{id}.{timestamp}.{body}"; it
            # floors the datetime to whole seconds, matching the header above.
            headers["webhook-signature"] = " ".join(
                signer.sign(key, signed_at, body) for signer in signers
            )
        return headers

    def _receipt(self, status: int, headers: Mapping[str, str]) -> str:
        receipt = f"http {status}"
        for name in self._config.receipt_headers:
            token = http.safe_token(headers.get(name))
            if token is not None:
                return f"{receipt} {name.lower()}={token}"
        return receipt

    def _body(self, request: SendRequest) -> tuple[str, bytes, Outcome | None]:
        """The body as sent (the payload, or its envelope), or why it cannot be sent."""
        try:
            # Compact and deterministic for a given payload; the exact string
            # is what gets signed, so it is sent byte for byte.
            body = json.dumps(
                envelope_of(request) if request.envelope else request.payload,
                separators=(",", ":"),
                ensure_ascii=False,
                allow_nan=False,
            )
        except (TypeError, ValueError):
            return "", b"", http.rejected("payload not json serializable")
        # The envelope's own bytes (type, timestamp, keys) do not count against the
        # payload's limit, which entry checked: what entered is sent, enveloped or not.
        data = body.encode("utf-8")
        if len(data) > self._config.max_request_bytes + (_ENVELOPE_ROOM if request.envelope else 0):
            return "", b"", http.rejected("payload too large")
        return body, data, None

    def _headers_for(self, request: SendRequest, body: str) -> dict[str, str]:
        return self._headers(
            request.idempotency_key,
            body,
            stale=request.stale,
            signers=self._signers_for(request.signing_secrets),
            envelope=request.envelope,
        )

    async def send(self, request: SendRequest) -> Outcome:
        """POST the payload once and classify the answer; never raises for failures."""
        cfg = self._config
        checked = self._checked.get(request.destination)
        if checked is None:
            checked = self._check_destination(request.destination)
            if len(self._checked) >= 10_000:  # bounded: destinations are few, but be safe
                self._checked.clear()
            self._checked[request.destination] = checked
        url, problem = checked
        if url is None:
            return http.rejected(problem or "url: malformed")
        if (bad_key := http.rejected_key(request.idempotency_key)) is not None:
            return bad_key
        body, data, refused = self._body(request)
        if refused is not None:
            return refused

        session = self._session.get()
        try:
            reply = await http.post_bounded(
                session,
                url,
                max_response_bytes=cfg.max_response_bytes,
                data=data,
                headers=self._headers_for(request, body),
            )
        except DestinationRefused as exc:
            return http.rejected(exc.reason)
        except aiohttp.InvalidURL:
            return http.rejected("url: invalid")
        except http.TRANSPORT_ERRORS as exc:
            refusal = _refusal(exc)
            if refusal is not None:
                return http.rejected(refusal.reason)
            return http.transport_outcome(exc)

        text = http.excerpt(reply.body.data, cfg.max_response_excerpt_bytes)
        if 200 <= reply.status < 300:
            return Outcome(
                kind=OutcomeKind.ACCEPTED,
                http_status=reply.status,
                receipt=self._receipt(reply.status, reply.headers),
                response_excerpt=text,
            )
        return http.classify_status(
            reply.status,
            reply.headers,
            now=datetime.now(UTC),
            response_excerpt=text,
            gone_disables=True,
        )

    async def close(self) -> None:
        """Close the shared session and the resolver; safe to call twice."""
        await self._session.close()
