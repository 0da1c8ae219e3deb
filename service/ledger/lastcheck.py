"""The last check before a request: the one statement between the last wait and the send.

After every wait (rate budget, destination slot), a consumer runs the claims it is about
to send through ``last_checks``: one guarded UPDATE per group that stamps each row still
held by its claim (``last_check_at``) and reads, as of its row lock, everything the send
decision needs (cancel, hold, stale, destination disabled, provider paused, lease, an
operator's stop). Nothing waits between that answer and the request. The claim stamps the
row too (it reads the same facts): a send that waits for nothing has its claim as last
check, and one that waits takes the stamp back first (``undo``).

The stamp is what an operator's cancel or dead-letter of a run reads (``service.ledger.control``):
both statements lock the row, so either the check finds the row already moved (and the
consumer sends nothing) or the operator finds it stamped, and treats its request as on the
wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.db import q
from service.ledger.model import Executor, SendFacts, State, send_facts


@dataclass(frozen=True)
class LastCheck:
    """One claimed row as its last check found it."""

    passed: bool  # stamped: still 'sending' under this claim, lease left, no stop asked
    state: State
    attempts: int  # the row's attempt now (another claim's if it differs from ours)
    lease_left_seconds: float  # on the database's clock (<= 0: run out)
    dead_letter_missing: bool  # 'dead' (an operator's dead-letter) and not dead-lettered yet
    last_error: str | None
    facts: SendFacts

    def moved_under(self, attempt: int) -> bool:
        """Did an operator end this claim's row before its request (cancel, dead-letter)?"""
        return self.attempts == attempt and self.state in (State.SKIPPED, State.DEAD)


async def last_checks(
    executor: Executor, claims: Sequence[tuple[int, int]]
) -> dict[tuple[int, int], LastCheck]:
    """Check and stamp claimed rows right before their requests: (id, attempt) -> check.

    A row missing from the answer no longer exists. A row whose check did not pass is not
    stamped: another claim holds it, its lease ran out, an operator moved it, or an
    operator asked it to stop (``facts.stop_action``).
    """
    rows = await executor.fetch(
        q("last_check"), [i for i, _ in claims], [attempt for _, attempt in claims]
    )
    by_id = {r["id"]: r for r in rows}
    checks: dict[tuple[int, int], LastCheck] = {}
    for delivery_id, attempt in claims:
        r = by_id.get(delivery_id)
        if r is None:
            continue
        checks[(delivery_id, attempt)] = LastCheck(
            passed=r["passed"] and r["attempts"] == attempt,
            state=State(r["state"]),
            attempts=r["attempts"],
            lease_left_seconds=r["lease_left_seconds"],
            dead_letter_missing=r["dead_letter_missing"],
            last_error=r["last_error"],
            facts=send_facts(r),
        )
    return checks


async def undo(executor: Executor, claims: Sequence[tuple[int, int]]) -> None:
    """The checks passed but the requests must wait again: not on the wire meanwhile."""
    await executor.execute(
        q("last_check_undo"), [i for i, _ in claims], [attempt for _, attempt in claims]
    )
