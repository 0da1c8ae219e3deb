"""Every SQL block the code names exists in service/sql/queries.sql, and every block there
is used: a typo in a ``q("...")`` name fails here, not at run time in production."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from service import db

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "publisher", "consumer")
QUERIES = REPO / "service" / "sql" / "queries.sql"


def _q_calls() -> list[tuple[str, int, ast.expr]]:
    """(file, line, first argument) of every call to ``q`` or ``<module>.q``."""
    calls = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text("utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "q":
                    where = str(path.relative_to(REPO))
                    calls.append((where, node.lineno, node.args[0]))
    return calls


def _used_names() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for where, line, arg in _q_calls():
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            used.setdefault(arg.value, []).append(f"{where}:{line}")
    return used


def test_every_q_call_names_its_block_with_a_literal() -> None:
    # Otherwise the scan below could not see which blocks are used.
    dynamic = [
        f"{where}:{line}"
        for where, line, arg in _q_calls()
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str))
    ]
    assert dynamic == []
    assert _used_names(), "the scan found no q() calls at all"


def test_every_name_the_code_uses_is_a_block_in_queries_sql() -> None:
    blocks = db.queries()
    missing = {name: at for name, at in _used_names().items() if name not in blocks}
    assert missing == {}


def test_every_block_in_queries_sql_is_used_by_the_code() -> None:
    unused = sorted(set(db.queries()) - set(_used_names()))
    assert unused == []


def test_block_names_are_unique() -> None:
    # db.queries() keeps the last of two blocks with one name: the first would be dead.
    names = re.findall(r"^-- name: (\w+)\s*$", QUERIES.read_text("utf-8"), re.MULTILINE)
    assert [n for n, count in Counter(names).items() if count > 1] == []
    assert len(names) == len(db.queries())
