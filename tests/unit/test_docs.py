"""The README documents every setting and every command the code has."""

from __future__ import annotations

import argparse
from pathlib import Path

from service.ops import cli, handlers
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


def test_every_subcommand_has_a_handler_and_every_handler_a_subcommand() -> None:
    import inspect

    def leaves(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return {prefix}
        return {
            leaf
            for sub in subs
            for name, child in sub.choices.items()
            for leaf in leaves(child, f"{prefix}.{name}" if prefix else name)
        }

    assert leaves(cli.build_parser()) == set(handlers.HANDLERS)
    for name, handler in handlers.HANDLERS.items():
        assert inspect.iscoroutinefunction(handler), name


def test_the_rabbitmq_permissions_in_deploy_md_name_every_exchange_and_queue() -> None:
    import re

    from service import amqp

    deploy = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    (pattern,) = re.findall(r"^RELAY_NAMES='(.+)'$", deploy, re.MULTILINE)
    topology = amqp.Topology.from_settings(Settings(amqp_namespace="relay"))
    exchanges = [topology.work_exchange, topology.delay_exchange, topology.dead_exchange]
    names = [*exchanges, *topology.timer_exchanges, *topology.all_queues()]
    assert [n for n in names if not re.fullmatch(pattern, n)] == []
