"""The ledger is the one door to delivery state: every named SQL block that writes
``deliveries``, ``delivery_attempts`` or ``publish_runs`` (or the records kept with them,
``run_actions`` and ``replays``) is run from a module of ``service/ledger/``. Any other
module may read through named blocks; a write from outside the package fails here, naming
the module and the block.

Two small scans: the SQL of each block in service/sql/queries.sql (which tables it
inserts into, updates or deletes from, data-modifying CTEs included), and the Python of
service/, publisher/ and consumer/ (which blocks each module names, by ``q("name")``,
``db.q("name")``, an alias of ``q`` or ``db.queries()["name"]``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from service import db

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "publisher", "consumer")
DOOR = "service/ledger/"
LEDGER_TABLES = frozenset(
    {"deliveries", "delivery_attempts", "publish_runs", "run_actions", "replays"}
)

_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)
_STRING = re.compile(r"'(?:[^']|'')*'")
_WRITE = re.compile(
    r"\b(INSERT\s+INTO|DELETE\s+FROM|UPDATE|MERGE\s+INTO|TRUNCATE(?:\s+TABLE)?)"
    r"\s+(?:ONLY\s+)?((?:\"?\w+\"?\.)?\"?\w+\"?)",
    re.IGNORECASE,
)
# UPDATE that is no statement: a row lock (FOR UPDATE, FOR NO KEY UPDATE), an upsert's
# DO UPDATE (it writes the INSERT's own table), a trigger's ON UPDATE.
_NOT_A_STATEMENT = {"for", "key", "do", "on", "or"}


def written_tables(sql: str) -> set[str]:
    """The tables a statement writes: INSERT INTO, UPDATE, DELETE FROM, MERGE INTO,
    TRUNCATE, at its top or inside a WITH (a data-modifying CTE)."""
    text = _STRING.sub("''", _COMMENT.sub(" ", sql))
    tables: set[str] = set()
    for m in _WRITE.finditer(text):
        before = text[: m.start()].split()
        if m.group(1).upper() == "UPDATE" and before and before[-1].lower() in _NOT_A_STATEMENT:
            continue
        tables.add(m.group(2).split(".")[-1].strip('"').lower())
    return tables


def ledger_writers() -> dict[str, set[str]]:
    """Block name -> the ledger tables it writes, for every block that writes one."""
    found = {}
    for name, sql in db.queries().items():
        tables = written_tables(sql) & LEDGER_TABLES
        if tables:
            found[name] = tables
    return found


def _q_aliases(tree: ast.Module) -> set[str]:
    """The names ``service.db.q`` is bound to in this module (``q`` unless renamed)."""
    names = {"q"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "service.db":
            names |= {a.asname or a.name for a in node.names if a.name == "q"}
    return names


def _is_queries_call(node: ast.expr) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Name) and func.id == "queries") or (
        isinstance(func, ast.Attribute) and func.attr == "queries"
    )


def block_references(source: str) -> tuple[list[tuple[str, int]], list[int]]:
    """(block, line) of every block a module names, and the lines that reach a block in a
    way this scan cannot read (a name that is not a literal, ``queries()`` used otherwise
    than subscripted by one)."""
    tree = ast.parse(source)
    aliases = _q_aliases(tree)
    named: list[tuple[str, int]] = []
    unreadable: list[int] = []
    seen_queries: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            callee = func.id if isinstance(func, ast.Name) else None
            if callee in aliases or (isinstance(func, ast.Attribute) and func.attr == "q"):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    named.append((arg.value, node.lineno))
                else:
                    unreadable.append(node.lineno)
        if isinstance(node, ast.Subscript) and _is_queries_call(node.value):
            seen_queries.add(id(node.value))
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                named.append((key.value, node.lineno))
            else:
                unreadable.append(node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_queries_call(node) and id(node) not in seen_queries:
            unreadable.append(node.lineno)
    return named, unreadable


def _modules() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(REPO)), path.read_text("utf-8"))
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    ]


def door_violations(modules: list[tuple[str, str]], writers: dict[str, set[str]]) -> list[str]:
    """'module:line runs block (writes tables)' for every ledger write outside the door."""
    found = []
    for where, source in modules:
        if where.startswith(DOOR):
            continue
        for name, line in block_references(source)[0]:
            if name in writers:
                tables = ", ".join(sorted(writers[name]))
                found.append(f"{where}:{line} runs {name} (writes {tables})")
    return found


def test_every_ledger_write_is_run_from_the_ledger_package() -> None:
    assert door_violations(_modules(), ledger_writers()) == []


def test_every_block_reference_is_one_the_scan_can_read() -> None:
    # Only service/db.py itself may hand out blocks by a name that is not a literal.
    unreadable = [
        f"{where}:{line}"
        for where, source in _modules()
        if where != "service/db.py"
        for line in block_references(source)[1]
    ]
    assert unreadable == []


def test_the_ledger_package_runs_the_writes_it_owns() -> None:
    # The scans found something: known writers of each table, run from the package.
    writers = ledger_writers()
    assert {"claim", "complete", "insert_deliveries", "event_add"} <= set(writers)
    assert set().union(*writers.values()) == LEDGER_TABLES
    run_from = {
        name: where
        for where, source in _modules()
        for name, _ in block_references(source)[0]
        if name in writers
    }
    assert set(run_from) == set(writers)
    assert all(where.startswith(DOOR) for where in run_from.values())


def test_the_sql_scan_tells_writes_from_reads_and_locks() -> None:
    assert written_tables("SELECT * FROM deliveries WHERE id = $1 FOR UPDATE") == set()
    assert written_tables("SELECT 1 FROM deliveries FOR NO KEY UPDATE SKIP LOCKED") == set()
    assert written_tables(
        "WITH held AS (SELECT id FROM deliveries FOR UPDATE OF d)\n"
        "UPDATE deliveries AS d SET state = 'queued' FROM held WHERE d.id = held.id"
    ) == {"deliveries"}
    assert written_tables(
        "WITH a AS (INSERT INTO delivery_attempts (x) VALUES (1) RETURNING 1)\n"
        "SELECT count(*) FROM a"
    ) == {"delivery_attempts"}
    assert written_tables(
        "INSERT INTO destinations (url) VALUES ($1)\n"
        "ON CONFLICT (url) DO UPDATE SET updated_at = now()"
    ) == {"destinations"}
    assert written_tables("DELETE FROM public.replays WHERE id = $1") == {"replays"}
    assert written_tables("-- UPDATE deliveries SET x\nSELECT 'UPDATE runs SET'") == set()


def test_the_python_scan_sees_each_way_a_block_is_named() -> None:
    source = (
        "from service import db\n"
        "from service.db import q\n"
        "from service.db import q as sql\n"
        "async def f(conn, name):\n"
        "    await conn.fetch(q('claim'))\n"
        "    await conn.fetch(db.q('complete'))\n"
        "    await conn.fetch(sql('release'))\n"
        "    await conn.fetch(db.queries()['mark_queued'])\n"
        "    await conn.fetch(db.q(name))\n"
        "    blocks = db.queries()\n"
    )
    named, unreadable = block_references(source)
    assert named == [("claim", 5), ("complete", 6), ("release", 7), ("mark_queued", 8)]
    assert sorted(unreadable) == [9, 10]


def test_a_write_from_outside_the_package_is_named_with_its_module() -> None:
    writers = {"claim": {"deliveries", "delivery_attempts"}}
    modules = [
        ("service/ledger/sending.py", "q('claim')\n"),
        ("consumer/store.py", "x = 1\ndb.q('claim')\n"),
        ("service/runs.py", "db.q('runs_recent')\n"),
    ]
    assert door_violations(modules, writers) == [
        "consumer/store.py:2 runs claim (writes deliveries, delivery_attempts)"
    ]
