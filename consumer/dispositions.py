"""What to do with a delivery message once its delivery was decided.

Every branch of the consume loop returns one of these; only ``Settler.settle``
(``consumer/settle.py``) acts on them (acks, nacks, publishes a copy), so the rule
"durable first, then acknowledged" is kept in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ack:
    """Done: the ledger holds the outcome, or the message is a duplicate."""


@dataclass(frozen=True)
class Redelay:
    """Park a copy in the delay tier that fits ``seconds``, then ack this one."""

    lane: str
    seconds: float


@dataclass(frozen=True)
class DeadLetter:
    """Publish to the dead-letter exchange with why, then ack.

    ``dead_row`` is (delivery id, attempt) when the ledger row is 'dead': once the broker
    confirms the dead letter, the row records it. Without it the message itself is bad.
    """

    reason: str
    dead_row: tuple[int, int] | None = None
    headers: dict[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class GiveBack:
    """Not finished here (shutdown, outage): hand a fresh copy to the lane, ack this one.

    A fresh copy, not a nack: a nacked message counts toward the broker's delivery limit,
    which is meant for messages that crash consumers, not for consumers that stop.
    """

    lane: str


@dataclass(frozen=True)
class Requeue:
    """A bug while handling: nack with requeue; the broker's delivery limit stops a
    message that always fails here."""


@dataclass(frozen=True)
class Leave:
    """The broker connection is gone: nothing can be sent, it returns the message."""


Disposition = Ack | Redelay | DeadLetter | GiveBack | Requeue | Leave
