"""The one narrow contract every channel adapter implements.

An adapter turns a claimed delivery into one provider request and classifies the
answer. It knows nothing of the ledger or the broker: timing (backoff, attempt
budgets) belongs to the retry policy, persistence to the consume loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol


class OutcomeKind(enum.StrEnum):
    """How a provider answered one attempt."""

    ACCEPTED = "accepted"  # 2xx: a webhook delivered; e-mail, SMS accepted (await a receipt)
    RETRY = "retry"  # 5xx, timeout, connection error: possibly delivered, retry with same key
    THROTTLED = "throttled"  # 429 or a provider throttle signal: retry after the given delay
    REJECTED = "rejected"  # other 4xx, refused destination: dead now


@dataclass(frozen=True)
class SendRequest:
    """Everything an adapter may use to build its request, read at send time."""

    delivery_id: int
    idempotency_key: str
    destination: str
    payload: dict[str, Any]
    attempt: int
    occurrence_at: datetime
    stale: bool = False  # sent although older than the reminder's stale_after
    # The destination's own signing secrets ('whsec_...', decrypted); None: the channel's
    # configured ones (RELAY_WEBHOOK_SIGNING_SECRETS). Never in a repr.
    signing_secrets: tuple[str, ...] | None = field(default=None, repr=False)
    envelope: bool = False  # wrap the payload in the Standard Webhooks event envelope
    event_type: str = "reminder.due"  # the envelope's type


@dataclass(frozen=True)
class Outcome:
    """The classified answer to one attempt. Never contains recipient data."""

    kind: OutcomeKind
    http_status: int | None = None
    receipt: str | None = None  # provider message id or a bounded status excerpt
    message_id: str | None = None  # the provider's id of the message (what receipts name)
    error: str | None = None  # short reason, e.g. "timeout", "http 503", "ssrf: private address"
    retry_after_seconds: float | None = None  # from Retry-After or a provider throttle signal
    response_excerpt: str | None = None  # bounded, for support work
    disable_destination: bool = False  # 410 Gone: stop sending to this destination
    # False only when no byte of the request can have reached the provider: the
    # adapter refused before sending (bad payload or key, refused destination) or
    # the connection failed. True for every answer, and for failures after
    # connecting (timeout, reset), where the provider may have acted on the
    # request: a retry must reuse the key and may still duplicate (SMS).
    possibly_delivered: bool = True


@dataclass(frozen=True)
class LookupRequest:
    """What reconciliation asks a provider: did a message for this delivery arrive?"""

    delivery_id: int
    idempotency_key: str
    destination: str
    payload: dict[str, Any]
    since: datetime  # no message for this delivery can be older (its occurrence)


@dataclass(frozen=True)
class Lookup:
    """The provider's answer: ``found`` (with its message id and status), ``not_found``,
    or ``unknown`` (it could not say: ``error``). Never contains recipient data."""

    answer: str  # found | not_found | unknown
    message_id: str | None = None
    status: str | None = None
    error: str | None = None


class Reconcilable(Protocol):
    """A channel whose provider can be asked whether a message exists."""

    async def lookup(self, request: LookupRequest) -> Lookup:
        """Ask the provider; never raises for provider failures (``unknown``)."""
        ...


class Channel(Protocol):
    """A channel adapter: key in, classified outcome out."""

    name: str

    async def send(self, request: SendRequest) -> Outcome:
        """Make one attempt. Must not raise for provider failures: classify them."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
