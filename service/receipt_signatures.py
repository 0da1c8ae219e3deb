"""The providers' signature schemes for status callbacks: pure, no I/O.

* Svix (Resend's webhooks): ``svix-id``, ``svix-timestamp``, ``svix-signature`` headers, the
  scheme Standard Webhooks adopted unchanged (HMAC-SHA256 over ``id.timestamp.body``, a
  5-minute timestamp tolerance). Verified with the ``standardwebhooks`` library; the
  ``svix-*`` headers are read as its ``webhook-*`` ones.
* Twilio: ``X-Twilio-Signature`` is base64(HMAC-SHA1(auth token, the full URL Twilio
  requested followed by every POST parameter, sorted by name, as name + value)). Like
  Twilio's own validators, the URL is tried as given, and with its default port added or
  removed (proxies differ on whether Twilio's URL had one).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

_SVIX_HEADERS = ("id", "timestamp", "signature")


class BadSignature(Exception):
    """The callback is unsigned, badly signed or outside the timestamp tolerance."""


def svix_message_id(headers: Mapping[str, str]) -> str | None:
    """The callback's id (``svix-id`` or ``webhook-id``): the same on every retry of it."""
    lowered = {k.lower(): v for k, v in headers.items()}
    return lowered.get("svix-id") or lowered.get("webhook-id")


def verify_svix(secrets: Iterable[str], body: bytes, headers: Mapping[str, str]) -> None:
    """Raise BadSignature unless one of ``secrets`` (``whsec_...``) signed ``body``."""
    lowered = {k.lower(): v for k, v in headers.items()}
    standard = {
        f"webhook-{name}": lowered.get(f"svix-{name}") or lowered.get(f"webhook-{name}") or ""
        for name in _SVIX_HEADERS
    }
    if not all(standard.values()):
        raise BadSignature("unsigned: no svix-id, svix-timestamp and svix-signature")
    last = "no secret configured"
    for secret in secrets:
        try:
            Webhook(secret).verify(body, standard, json_parse=False)
        except WebhookVerificationError as exc:
            last = str(exc)
        except ValueError:  # a malformed signature header or body encoding
            last = "malformed signature"
        else:
            return
    raise BadSignature(last)


def twilio_signature(auth_token: str, url: str, params: Iterable[tuple[str, str]]) -> str:
    """Twilio's signature of a request to ``url`` with these POST parameters."""
    data = url + "".join(f"{name}{value}" for name, value in sorted(params))
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def verify_twilio(
    auth_token: str, url: str, params: Iterable[tuple[str, str]], signature: str | None
) -> None:
    """Raise BadSignature unless ``signature`` is Twilio's for ``url`` and ``params``."""
    if not signature:
        raise BadSignature("unsigned: no X-Twilio-Signature")
    pairs = list(params)
    for candidate in _url_variants(url):
        expected = twilio_signature(auth_token, candidate, pairs)
        if hmac.compare_digest(expected.encode(), signature.encode()):
            return
    raise BadSignature("X-Twilio-Signature does not match")


def _url_variants(url: str) -> list[str]:
    """The URL as given, and with its scheme's default port removed or added."""
    parts = urlsplit(url)
    default = {"https": 443, "http": 80}.get(parts.scheme)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal goes back in brackets
        host = f"[{host}]"
    variants = [url]
    if default is None:
        return variants
    userinfo = parts.netloc.rpartition("@")[0]
    prefix = f"{userinfo}@" if userinfo else ""
    without = urlunsplit(parts._replace(netloc=f"{prefix}{host}"))
    with_default = urlunsplit(parts._replace(netloc=f"{prefix}{host}:{default}"))
    for variant in (without, with_default):
        if variant not in variants:
            variants.append(variant)
    return variants
