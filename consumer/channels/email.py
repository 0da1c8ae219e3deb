"""Email adapter for an HTTP email API shaped like Resend's ``POST /emails``.

Owns the request shape, the mapping from ``SendRequest`` to it, and the
classification of the provider's answer. One attempt is one POST.

Request::

    POST {base_url}/emails
    Authorization: Bearer <api_key>
    Idempotency-Key: <idempotency key>
    Content-Type: application/json

    {"from": <sender>, "to": [<destination>], "subject": ..., "text": ..., "html": ...,
     "tags": [{"name": "relay_delivery", "value": "<delivery id>"}]}

``SendRequest.destination`` is the recipient address. ``SendRequest.payload``
keys (anything else is ignored):

* ``subject`` (str, required, non-empty, single line)
* ``text`` (str, required): the plain-text body
* ``html`` (str, optional): an HTML alternative

Resend honours ``Idempotency-Key`` for 24 hours: a retry with the same key and
same body returns the original answer without sending again, so a timeout
retry does not produce a second email inside that window.

A 2xx answer ``{"id": "..."}`` gives the receipt: the message id, which the provider's
status callbacks name (``relay receipts``). The ``relay_delivery`` tag (the same for every
attempt of a delivery, so a retry's body is the same request under its key) comes back in
those callbacks too, so a receipt finds its delivery even before the outcome is written. Errors
``{"statusCode": 422, "name": "validation_error", "message": "..."}`` are
reported by ``name`` only: provider messages can quote the recipient address,
so they are never copied into an Outcome.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from pydantic import SecretStr

from consumer.channels import http
from consumer.channels.base import Lookup, LookupRequest, Outcome, OutcomeKind, SendRequest
from service import limits, receipt_events

__all__ = ["EmailChannel", "EmailConfig"]

# Reconciliation reads at most this many pages of 100 sent e-mails, each at most this big;
# a provider clock this far behind ours still counts as "since the occurrence".
_LOOKUP_PAGES = 10
_LOOKUP_BYTES = 1024 * 1024
_CLOCK_SLACK = timedelta(minutes=5)

# Deliberately loose: the provider validates addresses properly. We only keep
# out things that could change the request's meaning (lists, CR/LF, brackets).
_ADDRESS = re.compile(r"[^@\s<>,;\"]{1,64}@[^@\s<>,;\"]{1,255}")


@dataclass(frozen=True, kw_only=True)
class EmailConfig:
    """Settings for ``EmailChannel``. The API key is excluded from repr."""

    api_key: SecretStr | str = field(repr=False)
    sender: str  # "Reminders <reminders@example.com>"; domain must be verified at the provider
    base_url: str = "https://api.resend.com"
    timeout_seconds: float = 10.0
    connect_timeout_seconds: float = 3.0
    max_request_bytes: int = limits.EMAIL_MAX_REQUEST_BYTES  # as checked at entry
    max_response_bytes: int = 16 * 1024
    max_response_excerpt_bytes: int = 512
    user_agent: str = "reminder-relay-email/1"
    connection_limit: int = 20
    trust_env: bool = False  # honour HTTP(S)_PROXY for the provider connection

    def __post_init__(self) -> None:
        if not http.secret_value(self.api_key):
            raise ValueError("api_key is required")
        if not self.sender.strip() or "\r" in self.sender or "\n" in self.sender:
            raise ValueError("sender must be a non-empty single line")
        http.check_provider_config(self, "max_request_bytes")


def _build_message(sender: str, request: SendRequest) -> dict[str, object] | str:
    """The JSON body, or a rejection reason naming the offending payload key."""
    payload = request.payload
    message: dict[str, object] = {"from": sender, "to": [request.destination]}
    for key in ("subject", "text"):
        if key not in payload:
            return f"payload missing '{key}'"
        if not isinstance(payload[key], str):
            return f"payload invalid '{key}'"
    subject: str = payload["subject"]
    if not subject.strip() or "\r" in subject or "\n" in subject:
        return "payload invalid 'subject'"
    message["subject"] = subject
    message["text"] = payload["text"]
    html = payload.get("html")
    if html is not None:
        if not isinstance(html, str):
            return "payload invalid 'html'"
        message["html"] = html
    # The tag naming the delivery (Resend tags: ASCII letters, digits, '_' and '-').
    message["tags"] = [{"name": receipt_events.DELIVERY_TAG, "value": str(request.delivery_id)}]
    return message


class EmailChannel:
    """Channel adapter for a Resend-style email API, sharing one ClientSession."""

    name: str = "email"

    def __init__(self, config: EmailConfig) -> None:
        self._config = config
        self._url = f"{config.base_url}/emails"
        self._session = http.SharedSession(
            channel=self.name,
            timeout_seconds=config.timeout_seconds,
            connect_timeout_seconds=config.connect_timeout_seconds,
            connection_limit=config.connection_limit,
            trust_env=config.trust_env,
        )

    async def send(self, request: SendRequest) -> Outcome:
        """POST one email and classify the answer; never raises for failures."""
        cfg = self._config
        if not _ADDRESS.fullmatch(request.destination):
            return http.rejected("invalid recipient address")
        if (bad_key := http.rejected_key(request.idempotency_key)) is not None:
            return bad_key
        message = _build_message(cfg.sender, request)
        if isinstance(message, str):
            return http.rejected(message)
        data = json.dumps(message, ensure_ascii=False).encode("utf-8")
        if len(data) > cfg.max_request_bytes:
            return http.rejected("payload too large")

        headers = {
            "Authorization": f"Bearer {http.secret_value(cfg.api_key)}",
            "Idempotency-Key": request.idempotency_key,
            "Content-Type": "application/json",
            "User-Agent": cfg.user_agent,
        }
        try:
            reply = await http.post_bounded(
                self._session.get(),
                self._url,
                max_response_bytes=cfg.max_response_bytes,
                data=data,
                headers=headers,
            )
        except http.TRANSPORT_ERRORS as exc:
            return http.transport_outcome(exc)
        return self._classify(reply)

    def _classify(self, reply: http.HttpReply) -> Outcome:
        cfg = self._config
        parsed = http.try_json_object(reply.body.data)
        status = reply.status
        if 200 <= status < 300:
            message_id = http.safe_token(parsed.get("id")) if parsed else None
            # The success body is not excerpted: it is the provider's record of
            # our message and may echo recipient data.
            return Outcome(
                kind=OutcomeKind.ACCEPTED,
                http_status=status,
                receipt=message_id or f"http {status}",
                message_id=message_id,
            )

        name = http.safe_token(parsed.get("name"), 64) if parsed else None
        # Structured provider errors are summarised by name only (their
        # messages may quote addresses); a non-JSON body is a gateway page.
        text = (
            name
            if parsed is not None
            else http.excerpt(reply.body.data, cfg.max_response_excerpt_bytes)
        )
        now = datetime.now(UTC)
        outcome = http.classify_status(
            status,
            reply.headers,
            now=now,
            response_excerpt=text,
            detail=f"resend {name}" if name else None,
        )
        if status == 429 and outcome.retry_after_seconds is None:
            # Resend also sends ratelimit-reset (seconds until the window resets).
            reset = http.parse_retry_after(reply.headers.get("ratelimit-reset"), now)
            if reset is not None:
                return replace(outcome, retry_after_seconds=reset)
        if status == 409 and name == "concurrent_idempotent_requests":
            # The original request with this key is still in flight: not a
            # rejection, retry later and receive the original's answer.
            return replace(outcome, kind=OutcomeKind.RETRY)
        return outcome

    async def lookup(self, request: LookupRequest) -> Lookup:
        """Reconciliation: did an earlier attempt's e-mail reach the provider?

        Resend lists sent e-mails newest first (``GET /emails``, ``limit``, ``after``): one
        to this recipient with this subject, created since the occurrence, is the one an
        earlier attempt sent (an occurrence sends one e-mail). At most ``_LOOKUP_PAGES``
        pages are read; more e-mails than that since the occurrence, or any failure, is
        ``unknown``. Never raises for provider failures."""
        headers = {
            "Authorization": f"Bearer {http.secret_value(self._config.api_key)}",
            "User-Agent": self._config.user_agent,
        }
        since = request.since - _CLOCK_SLACK
        after: str | None = None
        for _ in range(_LOOKUP_PAGES):
            params = {"limit": "100"} | ({"after": after} if after else {})
            try:
                reply = await http.get_bounded(
                    self._session.get(),
                    self._url,
                    max_response_bytes=_LOOKUP_BYTES,
                    params=params,
                    headers=headers,
                )
            except http.TRANSPORT_ERRORS as exc:
                return Lookup("unknown", error=http.transport_outcome(exc).error)
            page = http.try_json_object(reply.body.data)
            items = page.get("data") if page else None
            if reply.status != 200 or page is None or not isinstance(items, list):
                return Lookup("unknown", error=f"http {reply.status}")
            for item in items:
                found = _match(item, request, since)
                if found is not None:
                    return found
            last = items[-1].get("id") if items and isinstance(items[-1], dict) else None
            if not page.get("has_more") or not isinstance(last, str):
                return Lookup("not_found")
            after = last
        return Lookup("unknown", error="more e-mails since the occurrence than one look reads")

    async def close(self) -> None:
        """Close the shared session; safe to call twice."""
        await self._session.close()


def _match(item: object, request: LookupRequest, since: datetime) -> Lookup | None:
    """``found`` for the e-mail the request's delivery sent, ``not_found`` once the list
    (newest first) is older than ``since``, None to read on."""
    if not isinstance(item, dict):
        return None
    created = _created(item.get("created_at"))
    if created is not None and created < since:
        return Lookup("not_found")
    to = item.get("to")
    recipients = [a.lower() for a in to if isinstance(a, str)] if isinstance(to, list) else []
    if request.destination.lower() in recipients and item.get("subject") == request.payload.get(
        "subject"
    ):
        message_id = http.safe_token(item.get("id"))
        if message_id is not None:
            return Lookup("found", message_id, http.safe_token(item.get("last_event"), 64))
    return None


def _created(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        created = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return created if created.tzinfo is not None else created.replace(tzinfo=UTC)
