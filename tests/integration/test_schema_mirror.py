"""The Python mirrors of the database's types match a migrated database."""

from __future__ import annotations

import re
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from service import db, ledger
from service.reminder_state import InactiveReason
from service.settings import Settings


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


async def test_the_skip_reason_check_keeps_every_reason_any_migration_allowed(
    pool: asyncpg.Pool,
) -> None:
    """Each migration that widens the skip reasons restates the whole list: none may drop a
    reason an earlier (or concurrently merged) migration allowed."""
    definition = await pool.fetchval(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c"
        " JOIN pg_class t ON t.oid = c.conrelid"
        " WHERE t.relname = 'deliveries' AND c.conname = 'deliveries_skip_reason_check'"
    )
    in_force = set(re.findall(r"'([a-z_]+)'::text", definition))
    ever: set[str] = set()
    for _, sql in db.migrations():
        for listed in re.findall(r"skip_reason IN \(([^)]*)\)", sql):
            ever |= set(re.findall(r"'([a-z_]+)'", listed))
    assert {"cancelled", "rescheduled", "suppressed"} <= ever
    assert in_force == ever


_RECEIPTS = (
    "0014a_receipt_states",
    "0014b_receipts",
    "0014c_suppressions",
    "0014d_reconciliations",
)

# Databases migrated before a merge: the migrations each lacks, and those it has numbered
# above some of them (so the runner must apply a migration below an applied one).
_MERGED_LATE = {
    # migrated by main: the receipts migrations came after its 0016 and 0017
    "main": (_RECEIPTS, {"0016_console_sessions", "0017_events"}),
    # migrated by the receipts branch before it merged main's overdue sweep and events
    "receipts": (("0011_overdue_sweep", "0017_events"), {*_RECEIPTS, "0016_console_sessions"}),
}

_SCHEMA = {
    "columns": "SELECT table_name, column_name, data_type, udt_name, is_nullable,"
    " column_default FROM information_schema.columns WHERE table_schema = 'public'",
    "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)"
    " FROM pg_constraint WHERE connamespace = 'public'::regnamespace",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'",
    "enums": "SELECT t.typname, array_agg(e.enumlabel ORDER BY e.enumsortorder)::text"
    " FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid GROUP BY t.typname",
    "functions": "SELECT proname, pg_get_functiondef(oid) FROM pg_proc"
    " WHERE pronamespace = 'public'::regnamespace",
    "triggers": "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid)"
    " FROM pg_trigger WHERE NOT tgisinternal",
}


async def _schema(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, list[tuple[Any, ...]]]:
    return {name: sorted(tuple(r) for r in await conn.fetch(sql)) for name, sql in _SCHEMA.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("migrated_by", sorted(_MERGED_LATE))
async def test_migrations_merged_below_an_applied_one_apply_on_top_to_the_fresh_schema(
    settings: Settings, pool: asyncpg.Pool, migrated_by: str
) -> None:
    """A database migrated by main (without the receipts migrations 0014a-d, with the
    later-numbered 0016 and 0017), or by the receipts branch before it merged main (without
    0011 and 0017): `relay migrate`'s runner applies exactly those it lacks on top, in
    order, and the schema is the one a fresh database gets from every migration in order
    (the test's own database, cloned from such a template)."""
    late, applied_above = _MERGED_LATE[migrated_by]
    assert set(late) < set(db.migration_versions())
    assert applied_above <= set(db.migration_versions()) - set(late)
    assert min(late) < max(applied_above)  # numbered below an applied one
    # Such a database had nothing numbered above its newest migration then (those were
    # written later, on top of every merge): it gets them after the late ones.
    then = max(applied_above)
    newer = [v for v in db.migration_versions() if v > then and v not in late]
    base = settings.database_url.get_secret_value()
    name = f"relay_t_late_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(base)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = urlunsplit(urlsplit(base)._replace(path=f"/{name}"))
    try:
        older = await asyncpg.create_pool(url, min_size=1, max_size=1)
        try:
            async with older.acquire() as conn:
                await conn.execute(db.q("migrations_table"))
                for version, sql in db.migrations():
                    if version not in late and version <= then:
                        async with conn.transaction():
                            await conn.execute(sql)
                            await conn.execute(db.q("migrations_record"), version)
            assert await db.migrate(older) == [*late, *newer]
            assert await db.migrate(older) == []
            on_top, fresh = await _schema(older), await _schema(pool)
        finally:
            await older.close()
    finally:
        admin = await asyncpg.connect(base)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
    for part, rows in fresh.items():
        assert on_top[part] == rows, part
