"""Expiring support holds: a state change and its email in one transaction.

A support hold is ``held`` until the customer confirms it or it expires. The expiry
worker moves due holds to ``expired`` and, in the same transaction, adds the "your
hold expired" email as an outbox intent (``service.outbox.add_intent``). Either both
commit or neither does: a worker killed before its commit leaves the hold ``held``
and no intent, and the next run does the work again. ``relay publish`` relays the
committed intents; a consumer sends them with the key ``outbox:hold:<id>:expired:email``.

Run it (the relay's database, migrated, with ``schema.sql`` applied)::

    RELAY_DATABASE_URL=postgresql://... python -m examples.holds.worker [--batch 100]

This is an example application, not part of the relay: its SQL lives beside it in
``queries.sql`` and ``schema.sql``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from service import ledger, outbox

HERE = Path(__file__).resolve().parent
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Testing only: with this set to 1, main() SIGKILLs its own process inside the first
# batch's transaction, after the UPDATE and the intent insert and before COMMIT.
CRASH_ENV = "HOLDS_CRASH_BEFORE_COMMIT"

# Awaited inside each batch's transaction just before it commits (a test seam).
BeforeCommit = Callable[[], Awaitable[None]]

_BLOCK = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def queries() -> dict[str, str]:
    """The example's named SQL blocks, loaded once from queries.sql."""
    parts = _BLOCK.split((HERE / "queries.sql").read_text("utf-8"))
    return {
        name: body.strip().rstrip(";").strip()
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def intent_key(hold_id: int) -> str:
    """The business identity of the expiry email: one per hold, whoever sends it."""
    return f"hold:{hold_id}:expired:email"


def expiry_email(hold_id: int, expires_at: datetime) -> dict[str, str]:
    """The email payload (keys the relay's email adapter reads: subject, text)."""
    return {
        "subject": "Your support hold has expired",
        "text": (
            f"Your support hold #{hold_id} expired at "
            f"{expires_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC. "
            "Reply to this email if you still need help."
        ),
    }


async def apply_schema(executor: ledger.Executor) -> None:
    """Create the holds table if missing (idempotent)."""
    await executor.execute((HERE / "schema.sql").read_text("utf-8"))


async def create_hold(executor: ledger.Executor, customer_email: str, expires_at: datetime) -> int:
    """Insert a new ``held`` hold; return its id."""
    hold_id = await executor.fetchval(queries()["create_hold"], customer_email, expires_at)
    return int(hold_id)


async def expire_due_holds(
    pool: asyncpg.Pool,
    now: datetime,
    batch: int,
    *,
    before_commit: BeforeCommit | None = None,
) -> int:
    """Expire up to ``batch`` holds due at ``now`` in one transaction; return how many.

    The due holds are locked with ``FOR UPDATE SKIP LOCKED``, so concurrent workers
    split the work and never wait for each other. Each hold moves held -> expired with
    a conditional UPDATE and gets its email intent in the same transaction. A hold
    whose confirmation committed first is no longer ``held`` and is not selected; one
    whose confirmation is in flight is locked and skipped; a confirmation that arrives
    while this transaction holds the lock waits, then finds the hold ``expired`` and
    changes nothing. So every hold ends confirmed XOR expired, and an intent exists
    exactly for the expired ones.

    ``before_commit``, if given, is awaited inside the transaction after all of the
    batch's writes (tests use it to hold the locks, or to die, before the commit).
    """
    expired = 0
    async with pool.acquire() as conn, conn.transaction():
        due = await conn.fetch(queries()["lock_due_holds"], now, batch)
        for hold in due:
            if await conn.fetchval(queries()["expire_hold"], hold["id"]) is None:
                continue  # not held any more: someone else won, nothing to tell
            await outbox.add_intent(
                conn,
                key=intent_key(hold["id"]),
                channel="email",
                destination=hold["customer_email"],
                payload=expiry_email(hold["id"], hold["expires_at"]),
            )
            expired += 1
        if before_commit is not None:
            await before_commit()
    return expired


async def confirm_hold(executor: ledger.Executor, hold_id: int) -> bool:
    """held -> confirmed; False if the hold is not ``held`` (expired or confirmed).

    A hold past its ``expires_at`` that no worker has expired yet can still be
    confirmed: the worker's period is the grace. An application that wants a hard
    deadline adds ``AND expires_at > now()`` to the statement.
    """
    return await executor.fetchval(queries()["confirm_hold"], hold_id) is not None


async def _crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def run(database_url: str, batch: int, *, crash_before_commit: bool = False) -> int:
    """Expire every hold due when the run starts, batch by batch; return how many."""
    # The relay's pool (service.db.create_pool) already sets the jsonb codec; a pool of
    # the application's own needs outbox.prepare_connection.
    pool = await asyncpg.create_pool(
        database_url, min_size=1, max_size=2, init=outbox.prepare_connection
    )
    try:
        now = datetime.now(UTC)
        total = 0
        while True:
            done = await expire_due_holds(
                pool, now, batch, before_commit=_crash if crash_before_commit else None
            )
            total += done
            # A short batch means nothing due is left that another worker does not hold.
            if done < batch:
                return total
    finally:
        await pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m examples.holds.worker``: one pass over the due holds, then exit."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.holds.worker",
        description="Expire due support holds and add their emails to the relay's outbox.",
        epilog=f"Database: RELAY_DATABASE_URL (default {DEFAULT_DATABASE_URL}). "
        f"Testing only: {CRASH_ENV}=1 SIGKILLs the process before its first commit.",
    )
    parser.add_argument("--batch", type=int, default=100, help="holds per transaction")
    parser.add_argument("--apply-schema", action="store_true", help="create the holds table")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    url = os.environ.get("RELAY_DATABASE_URL", DEFAULT_DATABASE_URL)

    async def go() -> int:
        if args.apply_schema:
            conn = await asyncpg.connect(url)
            try:
                await apply_schema(conn)
            finally:
                await conn.close()
        return await run(url, args.batch, crash_before_commit=os.environ.get(CRASH_ENV) == "1")

    try:
        total = asyncio.run(go())
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"holds worker: database error: {type(exc).__name__}", file=sys.stderr)
        return 3
    print(f"expired {total} holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
