"""Destination switches in the ledger: what an operator's enable of a disabled webhook
destination does to its held deliveries (neither final nor in flight). One statement, in
the enable's transaction (``service.destination_switch`` runs the rest: the reminders it
resumes, the destination's state, the record in ``destination_actions``):

* a row whose reminder was cancelled (or is gone) is skipped ``cancelled``;
* a row older than its reminder's ``stale_after`` (without ``send_stale``) is skipped
  ``stale``;
* the others are sent: a ``retrying`` row parked in the timer ladder is due at once (its
  parked message claims it when it comes back).

A dry run runs the same statement with its writes turned off and reports the same counts.
Disabling writes no delivery: a consumer holds a disabled destination's rows when its
claim or its last check reads the disable.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.db import q
from service.ledger.model import Connection


@dataclass(frozen=True)
class Held:
    """A destination's held rows by fate (those an applied enable moved)."""

    send: int
    stale: int
    cancelled: int


async def settle_held(conn: Connection, url: str, apply: bool) -> Held:
    """Settle (``apply``) or count (a dry run) the held rows of the destination ``url``,
    locking them in id order; run it in the enable's transaction."""
    row = await conn.fetchrow(q("enable_settle_held"), url, apply)
    assert row is not None  # an aggregate without GROUP BY always returns its row
    return Held(row["send"], row["stale"], row["cancelled"])
