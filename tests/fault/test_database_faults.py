"""PostgreSQL restarted, killed, stopped and hung under a running drain (issue 12).

Each test runs a drain of 1,200 webhook deliveries on a PostgreSQL cluster of
its own (and a module-wide throwaway RabbitMQ): two supervised ``relay consume``
processes, a ``relay publish`` run every 3 s, an in-process partner that counts one
logical event per idempotency key. A quarter of the way through, the database fails.
Then, whatever happened in between:

- every row is delivered within ``RELAY_LEASE_SECONDS`` + 30 s of the server's return,
  with ``RELAY_RESCUE_AFTER_SECONDS`` at its default (900 s): nothing may wait for rescue;
- the dead-letter queue holds messages only for rows that are ``dead`` (here: none);
- the partner saw exactly one logical event per key;
- every SIGTERM ended with exit 0 within ``RELAY_SHUTDOWN_GRACE_SECONDS`` + 10 s;
- the broker redelivered no message (RabbitMQ's ``messages_redelivered_total``): an
  outage is not a delivery failure and moves nothing toward ``x-delivery-limit``. This
  is the fact behind "0 dead letters" that holds whatever the outage's length and the
  nack rate, which decide only how many messages reach the limit;
- an outage shorter than ``RELAY_DATABASE_OUTAGE_MAX_SECONDS`` (60 s) makes no consumer
  exit (it waits, not ready, and resumes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support.fleet import Facts, Fleet, drain_settings, start_drain
from tests.support.nodes import PostgresNode, RabbitNode
from tests.support.proxy import ProxyThread
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

ROWS = 1200
COMMAND_TIMEOUT = 3.0  # RELAY_DATABASE_COMMAND_TIMEOUT_SECONDS in tests.support.fleet.FAULT_ENV


@asynccontextmanager
async def _drain(
    pg: PostgresNode,
    rabbit: RabbitNode,
    partner: RunningPartner,
    tmp_path: Path,
    proxy: ProxyThread | None = None,
) -> AsyncIterator[Fleet]:
    """A running drain whose processes reach ``pg`` (through ``proxy`` if given)."""
    assert partner.state.verify_secret is not None
    port = proxy.port if proxy is not None else pg.port
    settings = drain_settings(
        database_url=f"postgresql://postgres@127.0.0.1:{port}/postgres",
        amqp_url=rabbit.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
    )
    async with start_drain(
        settings, partner, tmp_path / "logs", rows=ROWS, ledger_url=pg.url, broker=rabbit
    ) as fleet:
        await fleet.wait_delivered(ROWS // 4, timeout=60)
        yield fleet


async def _after_return(fleet: Fleet, back: float, facts: Facts) -> None:
    """Every row delivered within RELAY_LEASE_SECONDS + 30 s of the server's return."""
    await fleet.expect_all_delivered(facts, within=fleet.settings.lease_seconds + 30, since=back)


async def _redeliveries_since(fleet: Fleet, before: int, facts: Facts, allowed: int = 0) -> None:
    """An outage is not a delivery failure: it must not move messages toward
    x-delivery-limit (each redelivery does; 20 of them dead-letter a message)."""
    redelivered = await fleet.redeliveries() - before
    fleet.note(f"broker redeliveries since the fault: {redelivered}")
    facts.check(
        redelivered <= allowed,
        f"the broker redelivered {redelivered} messages since the fault (allowed: {allowed}); "
        f"each counts toward x-delivery-limit ({fleet.settings.amqp_delivery_limit})",
    )


def _no_consumer_gave_up(fleet: Fleet, facts: Facts) -> None:
    unrequested = fleet.unrequested_exits()
    facts.check(
        not unrequested,
        "a consumer exited during an outage shorter than RELAY_DATABASE_OUTAGE_MAX_SECONDS: "
        + "; ".join(map(str, unrequested)),
    )


async def _recovered_cleanly(fleet: Fleet, back: float, before: int) -> None:
    """The facts every outage test asserts once the server is back at ``back``: all
    delivered within the bound, no redelivery since ``before``, no consumer gave up,
    dead letters only for dead rows, one logical event per key, SIGTERMs in bound."""
    facts = Facts(fleet)
    await _after_return(fleet, back, facts)
    await _redeliveries_since(fleet, before, facts)
    _no_consumer_gave_up(fleet, facts)
    await fleet.finish(facts)
    facts.assert_all()


async def test_drain_without_faults_is_clean(
    pg: PostgresNode, module_rabbit: RabbitNode, partner: RunningPartner, tmp_path: Path
) -> None:
    """Control: the harness and the facts hold when nothing fails."""
    async with _drain(pg, module_rabbit, partner, tmp_path) as fleet:
        before = await fleet.redeliveries()
        await _recovered_cleanly(fleet, time.monotonic(), before)


async def test_postgres_fast_restart_under_a_drain(
    pg: PostgresNode, module_rabbit: RabbitNode, partner: RunningPartner, tmp_path: Path
) -> None:
    async with _drain(pg, module_rabbit, partner, tmp_path) as fleet:
        before = await fleet.redeliveries()
        fleet.note("postgres: fast restart")
        await asyncio.to_thread(pg.restart)  # pg_ctl -m fast stop, then start
        back = fleet.note("postgres back")
        await _recovered_cleanly(fleet, back, before)


async def test_postgres_sigkill_and_restart_under_a_drain(
    pg: PostgresNode, module_rabbit: RabbitNode, partner: RunningPartner, tmp_path: Path
) -> None:
    async with _drain(pg, module_rabbit, partner, tmp_path) as fleet:
        before = await fleet.redeliveries()
        fleet.note("postgres: SIGKILL")
        await asyncio.to_thread(pg.kill)
        # Restarted 1 s later, as an orchestrator would at the earliest; restarted at
        # once, the server can be back before any consumer touched the dead one.
        await asyncio.sleep(1)
        await asyncio.to_thread(pg.restart)  # crash recovery on the same data and port
        back = fleet.note("postgres back")
        await _recovered_cleanly(fleet, back, before)


async def test_postgres_stopped_for_5_s_under_a_drain(
    pg: PostgresNode, module_rabbit: RabbitNode, partner: RunningPartner, tmp_path: Path
) -> None:
    async with _drain(pg, module_rabbit, partner, tmp_path) as fleet:
        before = await fleet.redeliveries()
        fleet.note("postgres: fast stop")
        await asyncio.to_thread(pg.stop)
        down = fleet.note("postgres down")
        await asyncio.sleep(5)  # the outage itself, not a synchronisation
        await asyncio.to_thread(pg.start)
        back = fleet.note(f"postgres back after {time.monotonic() - down:.1f} s down")
        await _recovered_cleanly(fleet, back, before)


async def test_postgres_hung_for_20_s_under_a_drain(
    pg: PostgresNode,
    pg_proxy: ProxyThread,
    module_rabbit: RabbitNode,
    partner: RunningPartner,
    tmp_path: Path,
) -> None:
    """The database accepts connections and answers nothing (a proxy holds every byte).

    During the hang each consumer reports not ready ("database": false) within the
    command timeout + 7 s, and a SIGTERM ends one within the grace bound; the other one
    stays up (20 s < RELAY_DATABASE_OUTAGE_MAX_SECONDS)."""
    hang_seconds = 20.0
    async with _drain(pg, module_rabbit, partner, tmp_path, proxy=pg_proxy) as fleet:
        first, second = fleet.supervisor.slots
        facts = Facts(fleet)
        before = await fleet.redeliveries()
        fleet.note("postgres: hang (proxy holds every byte)")
        await asyncio.to_thread(pg_proxy.hang)
        hung = time.monotonic()

        answers = await asyncio.gather(
            *(
                fleet.supervisor.wait_readyz(
                    slot,
                    COMMAND_TIMEOUT + 7,
                    lambda status, body: status == 503 and body.get("database") is False,
                )
                for slot in (first, second)
            )
        )
        for slot, (ok, status, body) in zip((first, second), answers, strict=True):
            if facts.check(
                ok,
                f'slot {slot.index}: /readyz did not answer 503 with "database": false '
                f"within {COMMAND_TIMEOUT + 7:.0f} s of the hang; last answer {status} {body}",
            ):
                fleet.note(f"slot {slot.index}: /readyz 503, database false")

        # Checked with every SIGTERM by finish(): exit 0 within the grace bound.
        await fleet.supervisor.sigterm(first, fleet.sigterm_bound)

        # The hang lasts 20 s, or until the SIGTERM was measured if that took longer
        # (ending it earlier would let a stuck process finish and hide the fault).
        await asyncio.sleep(max(0.0, hung + hang_seconds - time.monotonic()))
        await asyncio.to_thread(pg_proxy.pass_)
        back = fleet.note(f"postgres answers again after {time.monotonic() - hung:.1f} s")

        await _after_return(fleet, back, facts)
        # The SIGTERMed consumer may give its unstarted messages back by requeueing them.
        await _redeliveries_since(fleet, before, facts, allowed=fleet.settings.prefetch)
        facts.check(
            not second.exits,
            "the consumer left alone exited during a 20 s hang: "
            + "; ".join(map(str, second.exits)),
        )
        crashed = [e for e in fleet.unrequested_exits() if e.code != 3]
        facts.check(not crashed, "a consumer crashed: " + "; ".join(map(str, crashed)))
        await fleet.finish(facts)
        facts.assert_all()
