"""The suppression list: the one door to ``suppressions``.

An address (e-mail) or number (SMS) the provider said will not take messages — a hard
bounce, a complaint, an SMS error that is permanent — or that an operator added is
suppressed on its channel: every later send to it is skipped (``suppressed``) at the last
check before the request (the claim and the send check read it). Addresses are kept as the
ledger already keeps them in ``reminders`` and ``deliveries`` (normalised: an e-mail address
lower-cased, a number in E.164) so ``list`` shows what is suppressed; no log line or metric
carries one (a suppression is named by its id). Removing one keeps the row, with who
removed it, when and why: only the rows not removed suppress.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from service import db, entry, ledger
from service.receipt_events import RECEIPT_CHANNELS, ReceiptEvent

OPERATOR_REASON = "operator"


@dataclass(frozen=True)
class Suppression:
    """One row of the list."""

    id: int
    channel: str
    address: str
    reason: str  # hard_bounce | complaint | undeliverable | operator
    detail: str | None  # the provider's code, or the operator's words
    delivery_id: int | None  # the delivery whose receipt added it (None: an operator)
    created_by: str
    created_at: datetime
    removed_at: datetime | None = None
    removed_by: str | None = None
    removed_reason: str | None = None


class InvalidSuppression(ValueError):
    """An operator's address or channel that cannot be suppressed: one line saying why."""


def reason_of(event: ReceiptEvent) -> str | None:
    """Why a receipt suppresses its address, or None when it does not."""
    if not event.permanent:
        return None
    if event.outcome == "complained":
        return "complaint"
    return "hard_bounce" if event.channel == "email" else "undeliverable"


def check(channel: str, address: str) -> None:
    """Raise InvalidSuppression unless ``address`` is one ``channel`` sends to."""
    if channel not in RECEIPT_CHANNELS:
        raise InvalidSuppression(f"channel: must be one of {', '.join(sorted(RECEIPT_CHANNELS))}")
    problem = entry.destination_problem(channel, address, ())
    if problem is not None:
        raise InvalidSuppression(f"address: {problem}")


async def from_receipt(
    conn: ledger.Connection, event: ReceiptEvent, delivery_id: int
) -> int | None:
    """Suppress the destination of ``delivery_id`` if ``event`` says so; the new row's id,
    or None (not a suppressing receipt, or the address was suppressed already)."""
    reason = reason_of(event)
    if reason is None:
        return None
    found = await conn.fetchval(
        db.q("suppression_from_receipt"), delivery_id, reason, event.reason or event.event
    )
    return None if found is None else int(found)


async def add(
    executor: ledger.Executor, channel: str, address: str, operator: str, why: str
) -> Suppression | None:
    """An operator's suppression; None if the address was suppressed already."""
    check(channel, address)
    row = await executor.fetchrow(db.q("suppression_add"), channel, address, why, operator)
    return None if row is None else Suppression(**dict(row))


async def remove(
    executor: ledger.Executor, channel: str, address: str, operator: str, why: str
) -> Suppression | None:
    """Lift a suppression (kept, marked removed); None if the address was not suppressed."""
    check(channel, address)
    row = await executor.fetchrow(db.q("suppression_remove"), channel, address, operator, why)
    return None if row is None else Suppression(**dict(row))


async def listed(
    executor: ledger.Executor,
    channel: str | None = None,
    *,
    include_removed: bool = False,
    limit: int = 1000,
) -> list[Suppression]:
    """The list, newest first (``include_removed``: lifted ones too)."""
    rows = await executor.fetch(db.q("suppressions_list"), channel, include_removed, limit)
    return [Suppression(**dict(r)) for r in rows]
