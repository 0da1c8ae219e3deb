"""What a provider's status callback says, read from its verified body: pure, no I/O.

Two shapes, the two adapters' providers':

* e-mail, Resend-style events (JSON, Svix-signed): ``{"type": "email.delivered",
  "created_at": ..., "data": {"email_id": ..., "tags": {"relay_delivery": "42"}, "bounce":
  {"type": "Permanent", "subType": ...}}}``;
* SMS, Twilio-style status callbacks (a form, ``X-Twilio-Signature``): ``MessageSid``,
  ``MessageStatus`` (queued, sent, delivered, undelivered, failed, ...), ``ErrorCode``, and
  the ``delivery`` query parameter the SMS adapter put in its ``StatusCallback`` URL.

Each becomes one ``ReceiptEvent`` (or a refusal: one line saying why). Nothing here keeps a
recipient address or a message body: only the provider's ids, event names and codes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# Channels whose provider sends receipts: an accepted request waits for one.
RECEIPT_CHANNELS = frozenset({"email", "sms"})

# What an event says about one message, weakest first. A delivery settles on the strongest
# it has seen, so receipts in any order, or twice, end in the same state.
OUTCOMES = ("sent", "delayed", "delivered", "complained", "bounced")

_EMAIL_OUTCOMES = {
    "email.sent": "sent",
    "email.delivery_delayed": "delayed",
    "email.delivered": "delivered",
    "email.complained": "complained",
    "email.bounced": "bounced",
    "email.failed": "bounced",
}
_SMS_OUTCOMES = {
    "accepted": "sent",
    "scheduled": "sent",
    "queued": "sent",
    "sending": "sent",
    "sent": "sent",
    "delivered": "delivered",
    "read": "delivered",
    "undelivered": "bounced",
    "failed": "bounced",
}
# Twilio error codes that say the number itself will not take messages: it is suppressed.
# 21610 unsubscribed (STOP), 21614 not a mobile number, 30004 blocked, 30005 unknown
# handset, 30006 landline or unreachable carrier. Others (30003 handset off, 30007 carrier
# filter, 30008 unknown) may pass another time.
PERMANENT_SMS_ERRORS = frozenset({"21610", "21614", "30004", "30005", "30006"})
DELIVERY_TAG = "relay_delivery"  # the e-mail adapter's tag (consumer/channels/email.py)
DELIVERY_PARAMETER = "delivery"  # the SMS adapter's StatusCallback query parameter

_TOKEN = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
_REASON_UNSAFE = re.compile(r"[^A-Za-z0-9 ._:/+=-]")


@dataclass(frozen=True)
class ReceiptEvent:
    """One provider callback, as the ledger records it."""

    channel: str  # email | sms
    provider_message_id: str
    event_key: str  # the provider's id of this callback: a repeat has the same one
    event: str  # the provider's own name: email.bounced, undelivered, ...
    outcome: str  # one of OUTCOMES
    permanent: bool = False  # a hard bounce, a complaint, a permanent SMS error: suppress
    reason: str | None = None  # the provider's raw code (bounce type, error code)
    provider_at: datetime | None = None
    delivery_hint: int | None = None  # the delivery id the message carried (tag, query)


@dataclass(frozen=True)
class Refused:
    """A verified callback the ledger cannot take: why, and the HTTP status that says so."""

    reason: str
    status: int = 422


def email_event(body: Any, event_id: str) -> ReceiptEvent | Refused:
    """A Resend-style event (the parsed JSON body) with its Svix message id."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), dict):
        return Refused("not an event object with data", 400)
    kind = body.get("type")
    outcome = _EMAIL_OUTCOMES.get(kind) if isinstance(kind, str) else None
    if outcome is None or not isinstance(kind, str):
        return Refused("unsupported event type (subscribe only to the documented ones)")
    data = body["data"]
    message_id = _token(data.get("email_id"))
    if message_id is None:
        return Refused("no email_id", 400)
    reason, permanent = None, outcome == "complained"
    bounce = data.get("bounce")
    if outcome == "bounced" and isinstance(bounce, dict):
        bounce_type = _reason(bounce.get("type"))
        reason = "/".join(p for p in (bounce_type, _reason(bounce.get("subType"))) if p) or None
        permanent = (bounce_type or "").lower() == "permanent"
    return ReceiptEvent(
        channel="email",
        provider_message_id=message_id,
        event_key=event_id[:200],
        event=kind[:64],
        outcome=outcome,
        permanent=permanent,
        reason=reason,
        provider_at=_time(body.get("created_at")),
        delivery_hint=_delivery_id(_tag(data.get("tags"))),
    )


def sms_status(params: Mapping[str, str], query: Mapping[str, str]) -> ReceiptEvent | Refused:
    """A Twilio-style status callback: its form fields and the URL's query."""
    message_id = _token(params.get("MessageSid") or params.get("SmsSid"))
    status = (params.get("MessageStatus") or params.get("SmsStatus") or "").lower()
    if message_id is None or not status:
        return Refused("no MessageSid or MessageStatus", 400)
    outcome = _SMS_OUTCOMES.get(status)
    if outcome is None:
        return Refused("unsupported MessageStatus")
    code = _token(params.get("ErrorCode") or "") if params.get("ErrorCode") else None
    return ReceiptEvent(
        channel="sms",
        provider_message_id=message_id,
        event_key=f"{message_id}:{status}:{code or ''}"[:200],
        event=status[:64],
        outcome=outcome,
        permanent=outcome == "bounced" and code in PERMANENT_SMS_ERRORS,
        reason=code,
        delivery_hint=_delivery_id(query.get(DELIVERY_PARAMETER)),
    )


def _token(value: object) -> str | None:
    if isinstance(value, str) and _TOKEN.fullmatch(value):
        return value
    return None


def _reason(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    return _REASON_UNSAFE.sub("", value)[:60] or None


def _tag(tags: object) -> object:
    """The delivery tag's value: Resend sends tags as an object or as name/value pairs."""
    if isinstance(tags, dict):
        return tags.get(DELIVERY_TAG)
    if isinstance(tags, list):
        for tag in tags:
            if isinstance(tag, dict) and tag.get("name") == DELIVERY_TAG:
                return tag.get("value")
    return None


def _delivery_id(value: object) -> int | None:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    return None


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None
