"""`relay --help` is a manual: every option of every subcommand says what it does, and
every subcommand has a one-line description and an example."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from service.ops import cli


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
    commands = {"relay " + name.replace(".", " ") for name in cli.HANDLERS}
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
