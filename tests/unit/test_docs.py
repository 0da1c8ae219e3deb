"""The README documents every setting and every command the code has."""

from __future__ import annotations

import argparse
from pathlib import Path

from service.ops import cli
from service.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readme_configuration_table() -> None:
    missing = [n for n in Settings.model_fields if f"`RELAY_{n.upper()}`" not in README]
    assert missing == []


def test_every_subcommand_is_in_the_readme_commands_table() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name in sub.choices if f"`relay {name}" not in README]
    assert missing == []


def test_every_handler_resolves_to_a_coroutine_function() -> None:
    import inspect

    for name in cli.HANDLERS:
        assert inspect.iscoroutinefunction(cli.resolve(name)), name
