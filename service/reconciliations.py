"""Reconciliations of the duplicate window: the one door to ``reconciliations``.

When an e-mail or SMS attempt may have reached the provider without its answer being read
(lost with a crashed consumer; a timeout or a reset after connecting), the next claim asks
the provider before sending again, and records here what it asked about, the answer, and
what followed (the channel's policy). ``relay deliveries show`` lists them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service import db, ledger

# What follows each answer. Found: nothing is sent. Not found: sent now. The provider could
# not say: e-mail is sent with the same key (the provider keeps idempotency keys for 24
# hours: a second request is answered with the first message); SMS (no idempotency at the
# provider) is held and the provider asked again later, so no number gets a second text.
NO_RESEND = "no_resend"
RESEND = "resend"
UNANSWERED_POLICY = {"email": "resend_same_key", "sms": "hold"}


@dataclass(frozen=True)
class Reconciliation:
    """One question to the provider and what followed."""

    delivery_id: int
    attempt: int  # the claim that asked
    checked_attempts: tuple[int, ...]  # the earlier attempts it asked about
    answer: str  # found | not_found | unknown
    policy: str  # no_resend | resend | resend_same_key | hold
    provider_message_id: str | None = None
    provider_status: str | None = None
    error: str | None = None


def policy_for(channel: str, answer: str) -> str:
    """What follows ``answer`` on ``channel``."""
    if answer == "found":
        return NO_RESEND
    if answer == "not_found":
        return RESEND
    return UNANSWERED_POLICY.get(channel, RESEND)


async def candidates(executor: ledger.Executor, delivery_id: int, attempt: int) -> list[int]:
    """The attempts before ``attempt`` that may have reached the provider unanswered and
    that no answer from the provider covers yet (empty: nothing to ask)."""
    rows = await executor.fetch(db.q("reconcile_candidates"), delivery_id, attempt)
    return [r["attempt"] for r in rows]


async def record(executor: ledger.Executor, found: Reconciliation) -> int:
    """Record one reconciliation; its id."""
    return int(
        await executor.fetchval(
            db.q("reconciliation_record"),
            found.delivery_id,
            found.attempt,
            list(found.checked_attempts),
            found.answer,
            found.provider_message_id,
            found.provider_status,
            found.policy,
            found.error,
        )
    )


async def of_delivery(executor: ledger.Executor, delivery_id: int) -> list[dict[str, Any]]:
    """One delivery's reconciliations, oldest first."""
    rows: Sequence[Any] = await executor.fetch(db.q("reconciliations_of"), delivery_id)
    return [dict(r) for r in rows]
