"""Each ``relay`` subcommand's handler, by name (``HANDLERS``): a coroutine function
``(args, settings) -> exit code`` that imports the module doing the work when its
subcommand runs and hands over to it.

The imports are real (import-linter, mypy and a reader see what each subcommand depends
on) but inside the handler: ``relay --help`` and each process load only what their one
subcommand needs (a consumer never loads the publisher's code, nor the console's web
stack). The operator tools reach ``publisher`` and ``consumer`` only from here and from
the console's replay (contracts in ``pyproject.toml``).
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable, Coroutine
from typing import Any

from service.settings import Settings

Handler = Callable[[Namespace, Settings], Coroutine[Any, Any, int]]


# service.ops.commands ---------------------------------------------------------------------


async def migrate(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.migrate(args, settings)


async def reminders_load(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.reminders_load(args, settings)


async def reminders_list(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.reminders_list(args, settings)


async def reminders_show(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.reminders_show(args, settings)


async def reminders_cancel(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.reminders_cancel(args, settings)


async def status(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.status(args, settings)


async def pause(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.pause(args, settings)


async def resume(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.resume(args, settings)


async def partner(args: Namespace, settings: Settings) -> int:
    from service.ops import commands

    return await commands.partner(args, settings)


# service.ops.destinations -----------------------------------------------------------------


async def destinations_add(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.add(args, settings)


async def destinations_show(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.show(args, settings)


async def destinations_list(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.list_(args, settings)


async def destinations_rotate_secret(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.rotate_secret(args, settings)


async def destinations_disable(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.disable(args, settings)


async def destinations_enable(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.enable(args, settings)


async def destinations_envelope(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.envelope(args, settings)


async def destinations_rekey(args: Namespace, settings: Settings) -> int:
    from service.ops import destinations

    return await destinations.rekey(args, settings)


# service.ops.deliveries -------------------------------------------------------------------


async def deliveries_show(args: Namespace, settings: Settings) -> int:
    from service.ops import deliveries

    return await deliveries.show(args, settings)


async def deliveries_list(args: Namespace, settings: Settings) -> int:
    from service.ops import deliveries

    return await deliveries.list_(args, settings)


# service.ops.runs_cmd ---------------------------------------------------------------------


async def runs_list(args: Namespace, settings: Settings) -> int:
    from service.ops import runs_cmd

    return await runs_cmd.list_(args, settings)


async def runs_hold(args: Namespace, settings: Settings) -> int:
    from service.ops import runs_cmd

    return await runs_cmd.hold(args, settings)


async def runs_release(args: Namespace, settings: Settings) -> int:
    from service.ops import runs_cmd

    return await runs_cmd.release(args, settings)


async def runs_cancel(args: Namespace, settings: Settings) -> int:
    from service.ops import runs_cmd

    return await runs_cmd.cancel(args, settings)


async def runs_dead_letter(args: Namespace, settings: Settings) -> int:
    from service.ops import runs_cmd

    return await runs_cmd.dead_letter(args, settings)


# service.ops.event_types_cmd --------------------------------------------------------------


async def event_types_add(args: Namespace, settings: Settings) -> int:
    from service.ops import event_types_cmd

    return await event_types_cmd.add(args, settings)


async def event_types_list(args: Namespace, settings: Settings) -> int:
    from service.ops import event_types_cmd

    return await event_types_cmd.list_(args, settings)


async def event_types_show(args: Namespace, settings: Settings) -> int:
    from service.ops import event_types_cmd

    return await event_types_cmd.show(args, settings)


# service.ops.subscriptions_cmd ------------------------------------------------------------


async def destinations_subscribe(args: Namespace, settings: Settings) -> int:
    from service.ops import subscriptions_cmd

    return await subscriptions_cmd.subscribe(args, settings)


async def destinations_unsubscribe(args: Namespace, settings: Settings) -> int:
    from service.ops import subscriptions_cmd

    return await subscriptions_cmd.unsubscribe(args, settings)


# service.ops.suppressions_cmd -------------------------------------------------------------


async def suppressions_list(args: Namespace, settings: Settings) -> int:
    from service.ops import suppressions_cmd

    return await suppressions_cmd.list_(args, settings)


async def suppressions_add(args: Namespace, settings: Settings) -> int:
    from service.ops import suppressions_cmd

    return await suppressions_cmd.add(args, settings)


async def suppressions_remove(args: Namespace, settings: Settings) -> int:
    from service.ops import suppressions_cmd

    return await suppressions_cmd.remove(args, settings)


# service.ops.receipts_server --------------------------------------------------------------


async def receipts(args: Namespace, settings: Settings) -> int:
    from service.ops import receipts_server

    return await receipts_server.main(args, settings)


# service.ops.demo -------------------------------------------------------------------------


async def demo(args: Namespace, settings: Settings) -> int:
    from service.ops import demo

    return await demo.main(args, settings)


# service.ops.console.run ------------------------------------------------------------------


async def console(args: Namespace, settings: Settings) -> int:
    from service.ops.console import run

    return await run.main(args, settings)


# service.ops.console.operators_cmd --------------------------------------------------------


async def console_operators_add(args: Namespace, settings: Settings) -> int:
    from service.ops.console import operators_cmd

    return await operators_cmd.add(args, settings)


async def console_operators_remove(args: Namespace, settings: Settings) -> int:
    from service.ops.console import operators_cmd

    return await operators_cmd.remove(args, settings)


async def console_operators_list(args: Namespace, settings: Settings) -> int:
    from service.ops.console import operators_cmd

    return await operators_cmd.list_(args, settings)


# publisher.commands -----------------------------------------------------------------------


async def publish(args: Namespace, settings: Settings) -> int:
    from publisher import commands

    return await commands.publish(args, settings)


async def rescue(args: Namespace, settings: Settings) -> int:
    from publisher import commands

    return await commands.rescue(args, settings)


async def replay(args: Namespace, settings: Settings) -> int:
    from publisher import commands

    return await commands.replay(args, settings)


async def backfill(args: Namespace, settings: Settings) -> int:
    from publisher import commands

    return await commands.backfill(args, settings)


# consumer.commands ------------------------------------------------------------------------


async def consume(args: Namespace, settings: Settings) -> int:
    from consumer import commands

    return await commands.consume(args, settings)


# retention and erasure --------------------------------------------------------------------


async def purge(args: Namespace, settings: Settings) -> int:
    from service.ops import purge_cmd

    return await purge_cmd.main(args, settings)


async def erase(args: Namespace, settings: Settings) -> int:
    from service.ops import erase_cmd

    return await erase_cmd.erase(args, settings)


HANDLERS: dict[str, Handler] = {
    "migrate": migrate,
    "reminders.load": reminders_load,
    "reminders.list": reminders_list,
    "reminders.show": reminders_show,
    "reminders.cancel": reminders_cancel,
    "status": status,
    "pause": pause,
    "resume": resume,
    "partner": partner,
    "destinations.add": destinations_add,
    "destinations.show": destinations_show,
    "destinations.list": destinations_list,
    "destinations.rotate-secret": destinations_rotate_secret,
    "destinations.disable": destinations_disable,
    "destinations.enable": destinations_enable,
    "destinations.envelope": destinations_envelope,
    "destinations.rekey": destinations_rekey,
    "deliveries.show": deliveries_show,
    "deliveries.list": deliveries_list,
    "runs.list": runs_list,
    "runs.hold": runs_hold,
    "runs.release": runs_release,
    "runs.cancel": runs_cancel,
    "runs.dead-letter": runs_dead_letter,
    "event-types.add": event_types_add,
    "event-types.list": event_types_list,
    "event-types.show": event_types_show,
    "destinations.subscribe": destinations_subscribe,
    "destinations.unsubscribe": destinations_unsubscribe,
    "suppressions.list": suppressions_list,
    "suppressions.add": suppressions_add,
    "suppressions.remove": suppressions_remove,
    "receipts": receipts,
    "demo": demo,
    "console": console,
    "console-operators.add": console_operators_add,
    "console-operators.remove": console_operators_remove,
    "console-operators.list": console_operators_list,
    "publish": publish,
    "rescue": rescue,
    "replay": replay,
    "backfill": backfill,
    "consume": consume,
    "purge": purge,
    "erase": erase,
}
