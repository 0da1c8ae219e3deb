"""The size limits every module keeps: at most 400 lines per module and 60 per function
(methods, async and nested functions included; a function's lines run from its ``def``
to its last line, docstring and comments included).

A module or function past its limit fails here, named by file and line, so a limit is
kept by the suite rather than by hand. Split by concern when it fails, not by squeezing.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "publisher", "consumer")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def module_offences(path: Path, source: str) -> list[str]:
    """``file:line`` lines naming each limit ``source`` (the text of ``path``) exceeds."""
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}:1: module has {lines} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{name}:{node.lineno}: function {node.name} has {length} lines "
                    f"(limit {MAX_FUNCTION_LINES})"
                )
    return found


def test_every_module_and_function_keeps_its_size_limit() -> None:
    modules = _modules()
    # The walk found the code, not an empty tree (a moved package would pass vacuously).
    assert {p.relative_to(REPO).parts[0] for p in modules} == set(PACKAGES)
    assert len(modules) > 100
    offences = [o for p in modules for o in module_offences(p, p.read_text())]
    assert not offences, "\n".join(offences)


def _function(name: str, lines: int, indent: str = "") -> list[str]:
    """A function of exactly ``lines`` lines."""
    return [f"{indent}def {name}():", *(f"{indent}    x{i} = {i}" for i in range(lines - 1))]


def test_the_check_names_a_long_module_and_each_long_function_by_file_and_line() -> None:
    source_lines = [
        *_function("fits", MAX_FUNCTION_LINES),  # lines 1-60: at the limit, allowed
        "class Holder:",  # line 61
        "    async def too_long(self):",  # line 62: a method whose nested functions make it long
        *_function("nested", 58, indent="        "),  # lines 63-120: nested, 58 lines
        *(f"        y{i} = {i}" for i in range(2)),  # lines 121-122
        *_function("inner_too_long", MAX_FUNCTION_LINES + 1, indent="        "),  # 123-183
        *(f"# filler {i}" for i in range(MAX_MODULE_LINES)),
    ]
    source = "\n".join(source_lines)
    path = REPO / "service" / "example.py"
    assert module_offences(path, source) == [
        f"service/example.py:1: module has {len(source_lines)} lines (limit 400)",
        "service/example.py:62: function too_long has 122 lines (limit 60)",
        "service/example.py:123: function inner_too_long has 61 lines (limit 60)",
    ]


def test_a_module_of_400_lines_and_a_function_of_60_pass() -> None:
    source_lines = [*_function("fits", MAX_FUNCTION_LINES)]
    source_lines += ["#"] * (MAX_MODULE_LINES - len(source_lines))
    assert module_offences(REPO / "consumer" / "example.py", "\n".join(source_lines)) == []
