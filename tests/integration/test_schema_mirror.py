"""The Python mirrors of the database's types match a migrated database."""

from __future__ import annotations

import re

import asyncpg

from service import ledger
from service.reminder_state import InactiveReason


async def test_python_state_equals_the_database_delivery_state_enum_in_order(
    pool: asyncpg.Pool,
) -> None:
    labels = await pool.fetch(
        "SELECT e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid"
        " WHERE t.typname = 'delivery_state' ORDER BY e.enumsortorder"
    )
    assert [r["enumlabel"] for r in labels] == [s.value for s in ledger.State]


async def test_python_inactive_reasons_equal_the_reminders_inactive_reason_check(
    pool: asyncpg.Pool,
) -> None:
    definition = await pool.fetchval(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c"
        " JOIN pg_class t ON t.oid = c.conrelid"
        " WHERE t.relname = 'reminders' AND c.conname = 'reminders_inactive_reason_check'"
    )
    assert re.findall(r"'([a-z_]+)'::text", definition) == [r.value for r in InactiveReason]
