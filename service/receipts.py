"""Provider receipts in the ledger: the one door to ``receipts``. A receipt is appended
(never changed), then its delivery is settled by every receipt it has, in the same
transaction (``service.ledger.settlement``: ``accepted -> delivered | bounced``,
``delivered -> bounced``). A receipt that says the address will not take messages puts it
on the suppression list, in the same transaction too (``service.suppressions``).

The consumer's outcome write settles as well (in its own transaction), and both take the
delivery's row lock first, so whichever of the two commits second sees the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service import db, ledger, receipt_events, suppressions
from service.ledger import State, settlement
from service.receipt_events import ReceiptEvent


@dataclass(frozen=True)
class Recorded:
    """What one receipt did."""

    delivery_id: int
    new: bool  # False: the same callback had been recorded before (nothing added)
    state: State  # the delivery's state afterwards
    settled: bool  # this receipt moved the delivery's state
    suppression_id: int | None = None  # the suppression it added (a hard bounce, ...)


async def delivery_of(executor: ledger.Executor, event: ReceiptEvent) -> int | None:
    """The delivery ``event`` is about (by the attempt that sent its message, else the
    delivery id the message carried), or None: no such message in this ledger."""
    found = await executor.fetchval(
        db.q("receipt_delivery"), event.channel, event.provider_message_id, event.delivery_hint
    )
    return None if found is None else int(found)


async def record(conn: ledger.Connection, event: ReceiptEvent, delivery_id: int) -> Recorded:
    """Append ``event`` for ``delivery_id`` and settle the delivery, in one transaction
    (the caller's, or one of its own)."""
    async with conn.transaction():
        before = await conn.fetchval(db.q("receipt_lock"), delivery_id)
        receipt_id = await conn.fetchval(
            db.q("receipt_insert"),
            delivery_id,
            event.channel,
            event.provider_message_id,
            event.event_key,
            event.event,
            event.outcome,
            event.permanent,
            event.reason,
            event.provider_at,
        )
        moved = await settlement.settle(conn, [delivery_id])
        suppressed = await suppressions.from_receipt(conn, event, delivery_id)
    state = moved.get(delivery_id) or State(before)
    new = receipt_id is not None
    return Recorded(delivery_id, new, state, delivery_id in moved, suppressed)


async def of_delivery(executor: ledger.Executor, delivery_id: int) -> list[dict[str, Any]]:
    """One delivery's receipts, oldest first (never an address or a body: none is kept)."""
    return [dict(r) for r in await executor.fetch(db.q("receipts_of"), delivery_id)]


async def overdue_by_run(
    executor: ledger.Executor, run_ids: Sequence[int], wait_seconds: float
) -> dict[int, dict[str, int]]:
    """Per run, per channel: rows accepted longer than ``wait_seconds`` ago without a
    receipt that settled them."""
    found: dict[int, dict[str, int]] = {}
    for r in await executor.fetch(db.q("run_receipt_overdue"), list(run_ids), wait_seconds):
        found.setdefault(r["run_id"], {})[r["channel"]] = r["n"]
    return found


async def overdue_total(executor: ledger.Executor, wait_seconds: float) -> int:
    """Every row accepted longer than ``wait_seconds`` ago without a receipt."""
    return int(await executor.fetchval(db.q("receipt_overdue_total"), wait_seconds))


def waits_for_receipt(channel: str) -> bool:
    """Whether a delivery on ``channel`` is only accepted until a receipt says more."""
    return channel in receipt_events.RECEIPT_CHANNELS
