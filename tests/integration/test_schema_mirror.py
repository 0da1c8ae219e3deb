"""The Python mirrors of the database's types match a migrated database."""

from __future__ import annotations

import asyncpg

from service import ledger


async def test_python_state_equals_the_database_delivery_state_enum_in_order(
    pool: asyncpg.Pool,
) -> None:
    labels = await pool.fetch(
        "SELECT e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid"
        " WHERE t.typname = 'delivery_state' ORDER BY e.enumsortorder"
    )
    assert [r["enumlabel"] for r in labels] == [s.value for s in ledger.State]
