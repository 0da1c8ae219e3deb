"""Settling by receipts: the transitions a provider's receipt makes (``accepted ->
delivered | bounced``, ``delivered -> bounced``), never back, and never for a webhook row
(its 2xx is the receiver's word) or an open one.

A delivery is settled by every receipt the ledger holds for it: the strongest outcome
wins, so receipts that come twice, out of order, or before the consumer wrote the outcome
all converge on one state. Both callers run it where the delivery's row is locked by the
same transaction: ``service.receipts.record`` after appending a receipt, and the
consumer's outcome write of an ``accepted`` row; whichever commits second sees the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.db import q
from service.ledger.model import Connection, State


async def settle(conn: Connection, delivery_ids: Sequence[int]) -> dict[int, State]:
    """Apply the receipts the ledger holds to these deliveries; those moved, to their new
    state. Run it where the delivery's row is locked by the same transaction (or let it
    lock): after an outcome write, after a receipt."""
    if not delivery_ids:
        return {}
    rows = await conn.fetch(q("receipts_settle"), list(delivery_ids))
    return {r["id"]: State(r["state"]) for r in rows}
