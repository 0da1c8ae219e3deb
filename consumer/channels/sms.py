"""SMS adapter for an API shaped like Twilio's Messages resource.

Owns the request shape, the mapping from ``SendRequest`` to it, and the
classification of Twilio's answer. One attempt is one POST.

Request::

    POST {base_url}/2010-04-01/Accounts/{account_sid}/Messages.json
    Authorization: Basic base64(account_sid:auth_token)
    Content-Type: application/x-www-form-urlencoded

    To=<destination>&From=<from_number>&Body=<payload["body"]>
    (MessagingServiceSid=<sid> instead of From when configured)
    &StatusCallback=<status_callback_url>?delivery=<delivery id>   (when configured)

``SendRequest.destination`` is the recipient in E.164 form (``+15551234567``).
``SendRequest.payload["body"]`` is the text: a non-empty str of at most 1600
characters (counted as UTF-16 code units, which is never fewer than Twilio
counts). Other payload keys are ignored.

A 2xx answer ``{"sid": "SM...", "status": "queued", ...}`` gives the receipt
(the sid). With ``status_callback_url`` (``relay receipts``' public address), each message
asks Twilio for status callbacks there, naming its delivery in the query, so a callback
finds its delivery even before the outcome is written. Errors
``{"code": 21211, "message": "...", "status": 400}`` are reported as ``"twilio 21211"``;
Twilio messages quote phone numbers, so they are never copied into an Outcome, and neither
is the success body.

Idempotency: Twilio's Messages API has no idempotency key. Duplicates are
prevented only by the ledger's claim on the delivery. An attempt that times out
or loses the connection after the request was sent is RETRY with
``Outcome.possibly_delivered`` True, and the retry may send a second SMS.
The key is still sent as an ``Idempotency-Key`` header, which Twilio ignores:
it is harmless, and it lets an egress proxy or a provider fake correlate
attempts.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime

from pydantic import SecretStr

from consumer.channels import http
from consumer.channels.base import Lookup, LookupRequest, Outcome, OutcomeKind, SendRequest
from service import limits, receipt_events

__all__ = ["MAX_BODY_CHARS", "SmsChannel", "SmsConfig"]

MAX_BODY_CHARS = limits.SMS_MAX_BODY_CHARS  # Twilio's limit, as checked at entry
_E164 = re.compile(r"\+[1-9][0-9]{1,14}")
_ACCOUNT_SID = re.compile(r"AC[0-9a-fA-F]{32}")
_SERVICE_SID = re.compile(r"MG[0-9a-fA-F]{32}")
# Reconciliation reads at most this many pages of messages to one number, each at most this
# big; a provider clock this far behind ours still counts as "since the occurrence".
_LOOKUP_PAGES = 10
_LOOKUP_BYTES = 1024 * 1024
_CLOCK_SLACK = timedelta(minutes=5)


@dataclass(frozen=True, kw_only=True)
class SmsConfig:
    """Settings for ``SmsChannel``. The auth token is excluded from repr.

    Exactly one of ``from_number`` (E.164) and ``messaging_service_sid``
    ("MG...") must be set.
    """

    account_sid: str  # "AC" + 32 hex; also the basic-auth user name
    auth_token: SecretStr | str = field(repr=False)
    from_number: str | None = None
    messaging_service_sid: str | None = None
    base_url: str = "https://api.twilio.com"
    timeout_seconds: float = 10.0
    connect_timeout_seconds: float = 3.0
    max_response_bytes: int = 16 * 1024
    max_response_excerpt_bytes: int = 512
    user_agent: str = "reminder-relay-sms/1"
    status_callback_url: str | None = None  # where Twilio posts status callbacks
    connection_limit: int = 20
    trust_env: bool = False  # honour HTTP(S)_PROXY for the provider connection

    def __post_init__(self) -> None:
        if not _ACCOUNT_SID.fullmatch(self.account_sid):
            raise ValueError("account_sid must be 'AC' followed by 32 hex digits")
        if not http.secret_value(self.auth_token):
            raise ValueError("auth_token is required")
        if (self.from_number is None) == (self.messaging_service_sid is None):
            raise ValueError("set exactly one of from_number and messaging_service_sid")
        if self.from_number is not None and not _E164.fullmatch(self.from_number):
            raise ValueError("from_number must be E.164, e.g. +15551234567")
        if self.messaging_service_sid is not None and not _SERVICE_SID.fullmatch(
            self.messaging_service_sid
        ):
            raise ValueError("messaging_service_sid must be 'MG' followed by 32 hex digits")
        http.check_provider_config(self)


def _utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


class SmsChannel:
    """Channel adapter for Twilio-style SMS, sharing one ClientSession."""

    name: str = "sms"

    def __init__(self, config: SmsConfig) -> None:
        self._config = config
        self._url = f"{config.base_url}/2010-04-01/Accounts/{config.account_sid}/Messages.json"
        # Built by hand: aiohttp.BasicAuth is deprecated in 3.14 and
        # encode_basic_auth does not exist in older 3.x releases we allow.
        credentials = f"{config.account_sid}:{http.secret_value(config.auth_token)}"
        self._authorization = "Basic " + base64.b64encode(credentials.encode()).decode()
        self._session = http.SharedSession(
            channel=self.name,
            timeout_seconds=config.timeout_seconds,
            connect_timeout_seconds=config.connect_timeout_seconds,
            connection_limit=config.connection_limit,
            trust_env=config.trust_env,
        )

    def _form(self, request: SendRequest) -> dict[str, str] | str:
        """The form fields, or a rejection reason."""
        if not _E164.fullmatch(request.destination):
            return "invalid recipient number"
        if "body" not in request.payload:
            return "payload missing 'body'"
        body = request.payload["body"]
        if not isinstance(body, str) or not body.strip():
            return "payload invalid 'body'"
        if _utf16_len(body) > MAX_BODY_CHARS:
            return "payload too large"
        form = {"To": request.destination, "Body": body}
        if self._config.messaging_service_sid is not None:
            form["MessagingServiceSid"] = self._config.messaging_service_sid
        else:
            assert self._config.from_number is not None
            form["From"] = self._config.from_number
        if self._config.status_callback_url:
            form["StatusCallback"] = (
                f"{self._config.status_callback_url}"
                f"?{receipt_events.DELIVERY_PARAMETER}={request.delivery_id}"
            )
        return form

    async def send(self, request: SendRequest) -> Outcome:
        """POST one message and classify the answer; never raises for failures."""
        cfg = self._config
        if (bad_key := http.rejected_key(request.idempotency_key)) is not None:
            return bad_key
        form = self._form(request)
        if isinstance(form, str):
            return http.rejected(form)
        try:
            reply = await http.post_bounded(
                self._session.get(),
                self._url,
                max_response_bytes=cfg.max_response_bytes,
                data=form,  # aiohttp form-encodes a dict
                headers={
                    "Authorization": self._authorization,
                    "Idempotency-Key": request.idempotency_key,  # ignored by Twilio
                    "User-Agent": cfg.user_agent,
                    "Accept": "application/json",
                },
            )
        except http.TRANSPORT_ERRORS as exc:
            return http.transport_outcome(exc)
        return self._classify(reply)

    def _classify(self, reply: http.HttpReply) -> Outcome:
        parsed = http.try_json_object(reply.body.data)
        status = reply.status
        if 200 <= status < 300:
            sid = http.safe_token(parsed.get("sid"), 64) if parsed else None
            return Outcome(
                kind=OutcomeKind.ACCEPTED,
                http_status=status,
                receipt=sid or f"http {status}",
                message_id=sid,
            )

        code = parsed.get("code") if parsed else None
        code_token = http.safe_token(code, 16) if isinstance(code, int | str) else None
        # Structured Twilio errors are summarised by code only; a non-JSON
        # body is a gateway page and is excerpted.
        text: str | None = None
        if code_token:
            text = f"twilio {code_token}"
        elif parsed is None:
            text = http.excerpt(reply.body.data, self._config.max_response_excerpt_bytes)
        return http.classify_status(
            status,
            reply.headers,
            now=datetime.now(UTC),
            response_excerpt=text,
            detail=f"twilio {code_token}" if code_token else None,
        )

    async def lookup(self, request: LookupRequest) -> Lookup:
        """Reconciliation: did an earlier attempt's message reach Twilio?

        Twilio lists messages newest first (``GET Messages.json?To=...``, paged by
        ``next_page_uri``): one to this number, created since the occurrence, whose body
        hashes like this delivery's is the one an earlier attempt sent. At most
        ``_LOOKUP_PAGES`` pages are read; more than that, or any failure, is ``unknown``.
        Never raises for provider failures."""
        body = request.payload.get("body")
        digest = hashlib.sha256(body.encode()).digest() if isinstance(body, str) else None
        since = request.since - _CLOCK_SLACK
        url: str | None = self._url
        params: dict[str, str] | None = {"To": request.destination, "PageSize": "100"}
        for _ in range(_LOOKUP_PAGES):
            assert url is not None
            try:
                reply = await http.get_bounded(
                    self._session.get(),
                    url,
                    max_response_bytes=_LOOKUP_BYTES,
                    params=params,
                    headers={"Authorization": self._authorization, "Accept": "application/json"},
                )
            except http.TRANSPORT_ERRORS as exc:
                return Lookup("unknown", error=http.transport_outcome(exc).error)
            page = http.try_json_object(reply.body.data)
            messages = page.get("messages") if page else None
            if reply.status != 200 or page is None or not isinstance(messages, list):
                return Lookup("unknown", error=f"http {reply.status}")
            for message in messages:
                found = _match(message, digest, since)
                if found is not None:
                    return found
            next_page = page.get("next_page_uri")
            if not isinstance(next_page, str) or not next_page.startswith("/"):
                return Lookup("not_found")
            url, params = f"{self._config.base_url}{next_page}", None
        return Lookup("unknown", error="more messages since the occurrence than one look reads")

    async def close(self) -> None:
        """Close the shared session; safe to call twice."""
        await self._session.close()


def _match(message: object, digest: bytes | None, since: datetime) -> Lookup | None:
    """``found`` for the message with this body's hash, ``not_found`` once the list
    (newest first) is older than ``since``, None to read on."""
    if not isinstance(message, dict):
        return None
    try:
        created = parsedate_to_datetime(str(message.get("date_created")))
    except (TypeError, ValueError, IndexError):
        created = None
    if created is not None and created.tzinfo is not None and created < since:
        return Lookup("not_found")
    body = message.get("body")
    if (
        digest is not None
        and isinstance(body, str)
        and hashlib.sha256(body.encode()).digest() == digest
    ):
        sid = http.safe_token(message.get("sid"), 64)
        if sid is not None:
            return Lookup("found", sid, http.safe_token(message.get("status"), 64))
    return None
