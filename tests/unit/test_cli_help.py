"""`relay --help` is a manual: every option of every subcommand says what it does, and
every subcommand has a one-line description and an example."""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
from collections.abc import Iterator

import pytest

from service.ops import cli, handlers


def _parsers(
    parser: argparse.ArgumentParser, name: str = "relay"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = dict(_parsers(cli.build_parser()))


def test_every_command_with_a_handler_is_covered() -> None:
    commands = {"relay " + name.replace(".", " ") for name in handlers.HANDLERS}
    assert commands <= set(PARSERS)


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_and_argument_has_help(name: str) -> None:
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in PARSERS[name]._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert missing == []


@pytest.mark.parametrize("name", [n for n in PARSERS if n != "relay"])
def test_every_subcommand_has_a_one_line_description_and_an_example(name: str) -> None:
    parser = PARSERS[name]
    assert parser.description and "\n" not in parser.description
    assert parser.epilog and parser.epilog.startswith("example")
    examples = [line.strip() for line in parser.epilog.splitlines()[1:] if line.strip()]
    assert any(example.startswith(name) or f"| {name}" in example for example in examples)
    assert name in parser.format_help()


def test_version_is_an_option() -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["--version"])
    assert exited.value.code == 0


def _handler_targets() -> set[str]:
    """The modules the handlers import (inside each handler: when its subcommand runs)."""
    tree = ast.parse(inspect.getsource(handlers))
    return {
        f"{node.module}.{alias.name}"
        for fn in tree.body
        if isinstance(fn, ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_relay_help_loads_no_command_module() -> None:
    # What keeps `relay --help` (and each process's start) quick: building the parser
    # imports none of the modules the handlers run, but the one whose parser it reuses.
    targets = _handler_targets()
    assert {"publisher.commands", "consumer.commands", "service.ops.console.run"} <= targets
    code = "import sys; from service.ops import cli; cli.build_parser(); print(*sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    loaded = {m for m in found if m.split(".")[0] in ("service", "publisher", "consumer")}
    assert loaded & targets == {"service.ops.destinations"}
    assert not any(m.split(".")[0] in ("publisher", "consumer") for m in loaded)
