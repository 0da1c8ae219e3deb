"""A drain to break: real ``relay`` processes run as a deployment would run them.

A ``Fleet`` owns, for one test:

- the ledger it reads directly (never through a fault proxy), migrated by ``relay
  migrate`` and loaded with one-shot webhook reminders due now;
- a ``Supervisor`` that keeps ``relay consume`` processes running as a Kubernetes
  Deployment does: a process that exits is started again after ``restart_delay``, and
  every exit is recorded (slot, pid, code, whether the test asked for it, how long a
  SIGTERM took);
- a ``relay publish`` loop (the CronJob): one run every ``publish_every`` seconds, each
  killed at ``publish_deadline`` as ``activeDeadlineSeconds`` would;
- an in-process partner (``service.ops.partner``) that honours idempotency keys and counts
  one logical event per key.

Typical use::

    async with start_drain(settings, partner, tmp_path, rows=3000) as fleet:
        await fleet.wait_delivered(300, timeout=60)
        ...                                 # break something
        back = fleet.note("server back")
        facts = Facts(fleet)
        await fleet.expect_all_delivered(facts, within=settings.lease_seconds + 30)
        await fleet.finish(facts)           # stop; dead letters, partner, SIGTERM bounds
        facts.assert_all()

Every wait is a predicate with a deadline. A ``Facts`` object collects what did not hold
so a failing test reports every broken fact at once, with the fleet's timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import asyncpg
from pydantic import SecretStr

from service import brokers, db, messages, servers
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import forked
from tests.support import relay as rs
from tests.support.nodes import RabbitNode, free_port
from tests.support.relay import RunningPartner

FINAL_STATES = frozenset({"delivered", "dead", "skipped"})
#: What a SIGTERM may take beyond RELAY_SHUTDOWN_GRACE_SECONDS (interpreter exit, closes).
SIGTERM_MARGIN = 10.0

#: Settings of the design (issue 12) not in every Settings yet: passed as environment.
#: The lead's defaults are 10 / 60 / 15 / 10 / 120; drains use a short command timeout.
FAULT_ENV: dict[str, str] = {
    "DATABASE_COMMAND_TIMEOUT_SECONDS": "3",
    "DATABASE_OUTAGE_MAX_SECONDS": "60",
}


def drain_settings(
    *,
    database_url: str,
    amqp_url: str,
    secret: str,
    state_dir: Path,
    namespace: str | None = None,
    **overrides: Any,
) -> Settings:
    """Settings for a drain under faults: short lease, timeouts and delay tiers, one
    destination allowed the whole prefetch. The prefetch (200), the delivery limit (20)
    and rescue (900 s) keep their defaults unless overridden: a fault must not be
    hidden by a small prefetch or rescued by accident."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "amqp_url": amqp_url,
        "amqp_namespace": namespace or f"f{uuid.uuid4().hex[:10]}",
        "allow_networks": "127.0.0.0/8",
        "webhook_signing_secrets": [secret],
        "delay_tiers_seconds": [0.5, 1.0, 2.0, 5.0],
        "retry_base_seconds": 0.5,
        "retry_multiplier": 2.0,
        "retry_max_seconds": 5.0,
        "lease_seconds": 10.0,
        "http_timeout_seconds": 5.0,
        "shutdown_grace_seconds": 5.0,
        "destination_max_share": 1.0,
        "publish_batch_size": 500,
        "health_port": 0,
        "state_dir": state_dir,
    }
    values.update(overrides)
    return Settings(**values)


# --------------------------------------------------------------------------- waiting


async def eventually(
    predicate: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.2
) -> bool:
    """Poll ``predicate`` until true or the deadline; an exception counts as false
    (a ledger check during a database outage simply fails)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await predicate():
                return True
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            pass
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


# ---------------------------------------------------------------------------- ledger


class Ledger:
    """Reads the ledger over short direct connections (a broken pool never lingers)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.url, timeout=5)
        try:
            return list(await asyncio.wait_for(conn.fetch(sql, *args), 15))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        rows = await self.fetch(sql, *args)
        return rows[0][0] if rows else None

    async def states(self) -> dict[str, int]:
        rows = await self.fetch("SELECT state::text AS s, count(*) AS n FROM deliveries GROUP BY 1")
        return {r["s"]: int(r["n"]) for r in rows}

    async def count(self, *states: str) -> int:
        return int(
            await self.fetchval(
                "SELECT count(*) FROM deliveries WHERE state::text = ANY($1::text[])", list(states)
            )
        )

    async def rows(self) -> list[asyncpg.Record]:
        return await self.fetch(
            "SELECT id, idempotency_key, state::text AS state, attempts FROM deliveries ORDER BY id"
        )

    async def states_of(self, ids: list[int]) -> dict[int, str]:
        rows = await self.fetch(
            "SELECT id, state::text AS state FROM deliveries WHERE id = ANY($1::bigint[])", ids
        )
        return {int(r["id"]): str(r["state"]) for r in rows}

    async def attempt_outcomes(self) -> dict[str, int]:
        rows = await self.fetch(
            "SELECT outcome, count(*) AS n FROM delivery_attempts GROUP BY 1 ORDER BY 1"
        )
        return {str(r["outcome"]): int(r["n"]) for r in rows}

    async def rescued(self) -> int:
        return int(await self.fetchval("SELECT coalesce(sum(rescued_count), 0) FROM publish_runs"))


# ----------------------------------------------------------------------- dead letters


@dataclass(frozen=True)
class DeadLetter:
    delivery_id: int | None
    reason: str


async def dead_letters(amqp_url: str, namespace: str) -> list[DeadLetter]:
    """Every message in ``<namespace>.dead-letters``, read without consuming it (the
    channel closes with the messages unacked, so they stay in the queue). A URL naming
    several nodes is read through the first that answers."""
    connection = await brokers.connect_first(
        servers.one_url_per_host(amqp_url), lambda url: aio_pika.connect(url, timeout=10), first=0
    )
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"{namespace}.dead-letters", passive=True)
        letters: list[DeadLetter] = []
        while True:
            message = await queue.get(no_ack=False, fail=False, timeout=10)
            if message is None:
                break
            headers = message.headers or {}
            reason = str(
                headers.get("x-relay-reason") or headers.get("x-first-death-reason") or "?"
            )
            try:
                delivery_id: int | None = messages.decode(message.body).delivery_id
            except messages.MessageError:
                delivery_id = None
            letters.append(DeadLetter(delivery_id, reason))
        await channel.close()
    return letters


# ----------------------------------------------------------------------------- health


async def get_json(port: int, path: str, timeout: float = 3.0) -> tuple[int | None, dict[str, Any]]:
    """GET http://127.0.0.1:PORT/PATH: (status, JSON body); (None, {"error": why}) when
    nothing answers within ``timeout``."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(f"http://127.0.0.1:{port}{path}") as response,
        ):
            try:
                body = await response.json(content_type=None)
            except ValueError:
                body = {}
            return response.status, body if isinstance(body, dict) else {"body": body}
    except TimeoutError:
        return None, {"error": f"no answer within {timeout:.0f} s"}
    except (aiohttp.ClientError, OSError) as exc:
        return None, {"error": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------------------- supervisor


@dataclass(frozen=True)
class Exit:
    """One consumer process that ended."""

    slot: int
    pid: int
    code: int
    started: float  # monotonic
    ended: float
    #: The test sent SIGTERM (or stopped the fleet); None: the process ended on its own.
    sigterm_seconds: float | None
    #: The test SIGKILLed it after a SIGTERM took longer than the bound.
    killed: bool = False

    @property
    def requested(self) -> bool:
        return self.sigterm_seconds is not None

    def __str__(self) -> str:
        how = (
            f"SIGTERM -> exit {self.code} after {self.sigterm_seconds:.1f} s"
            + (" (SIGKILLed at the bound)" if self.killed else "")
            if self.sigterm_seconds is not None
            else f"exit {self.code} on its own after {self.ended - self.started:.1f} s"
        )
        return f"slot {self.slot} pid {self.pid}: {how}"


@dataclass
class Slot:
    """One replica: the process that currently runs for it, and its history."""

    index: int
    env: dict[str, str]
    log: Path
    proc: forked.RelayProcess | None = None
    health_port: int = 0
    started: float = 0.0
    term_sent: float | None = None
    killed: bool = False
    keep_running: bool = True
    exits: list[Exit] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    generation: int = 0
    #: Cleared: a process that exits is restarted only once the test sets it again.
    restarts_allowed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    """Keeps ``relay consume`` processes running, as a Deployment does."""

    def __init__(
        self,
        settings: Settings,
        log_dir: Path,
        env: Mapping[str, str],
        *,
        restart_delay: float = 1.0,
        note: Callable[[str], float] | None = None,
    ) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.env = dict(env)
        self.restart_delay = restart_delay
        self.slots: list[Slot] = []
        self.exits: list[Exit] = []
        self._note = note or (lambda _: time.monotonic())

    async def add(self, *, hold_restarts: bool = False, **env: str) -> Slot:
        """Start one more replica (its own health port, log file and extra env). With
        ``hold_restarts``, it is not restarted until ``slot.restarts_allowed`` is set."""
        slot = Slot(len(self.slots), dict(env), self.log_dir / f"consumer-{len(self.slots)}.log")
        if not hold_restarts:
            slot.restarts_allowed.set()
        self.slots.append(slot)
        started = asyncio.Event()
        slot.task = asyncio.create_task(self._keep(slot, started))
        await started.wait()
        return slot

    async def _keep(self, slot: Slot, started: asyncio.Event) -> None:
        while slot.keep_running:
            slot.health_port = free_port()
            slot.term_sent, slot.killed = None, False
            slot.proc = await rs.start_consumer(
                self.settings,
                slot.log,
                HEALTH_PORT=str(slot.health_port),
                **{**self.env, **slot.env},
            )
            slot.started = time.monotonic()
            slot.generation += 1
            self._note(f"slot {slot.index}: started pid {slot.proc.pid}")
            started.set()
            code = await slot.proc.wait()
            ended = time.monotonic()
            record = Exit(
                slot.index,
                slot.proc.pid,
                code,
                slot.started,
                ended,
                None if slot.term_sent is None else ended - slot.term_sent,
                slot.killed,
            )
            slot.exits.append(record)
            self.exits.append(record)
            self._note(str(record))
            if slot.keep_running:
                await slot.restarts_allowed.wait()
                await asyncio.sleep(self.restart_delay)  # the orchestrator's restart delay

    async def wait_exit(self, slot: Slot, count: int, timeout: float) -> Exit | None:
        """The slot's ``count``-th exit (1-based), waiting up to ``timeout`` for it."""

        async def ended() -> bool:
            return len(slot.exits) >= count

        if await eventually(ended, timeout, interval=0.05):
            return slot.exits[count - 1]
        return None

    async def sigterm(self, slot: Slot, bound: float, *, restart: bool = True) -> Exit:
        """SIGTERM the slot's process and wait for it up to ``bound`` seconds; past the
        bound it is SIGKILLed (so the test goes on) and the exit says so."""
        proc = slot.proc
        assert proc is not None and proc.returncode is None, f"slot {slot.index} is not running"
        slot.keep_running = restart
        count = len(slot.exits) + 1
        slot.term_sent = time.monotonic()
        self._note(f"slot {slot.index}: SIGTERM pid {proc.pid}")
        proc.send_signal(signal.SIGTERM)
        done = await self.wait_exit(slot, count, bound)
        if done is None:
            slot.killed = True
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            done = await self.wait_exit(slot, count, 30)
        assert done is not None, f"slot {slot.index} pid {proc.pid} survived SIGKILL"
        return done

    async def restart(self, slot: Slot) -> None:
        """Start a slot again that was stopped with ``restart=False``."""
        assert slot.task is not None and slot.task.done(), "slot still supervised"
        slot.keep_running = True
        started = asyncio.Event()
        slot.task = asyncio.create_task(self._keep(slot, started))
        await started.wait()

    async def ready(self, slot: Slot) -> tuple[int | None, dict[str, Any]]:
        return await get_json(slot.health_port, "/readyz")

    async def live(self, slot: Slot) -> tuple[int | None, dict[str, Any]]:
        return await get_json(slot.health_port, "/livez")

    async def wait_ready(self, slot: Slot, timeout: float = 30) -> bool:
        ok, _, _ = await self.wait_readyz(slot, timeout, lambda status, _: status == 200)
        return ok

    async def wait_readyz(
        self,
        slot: Slot,
        timeout: float,
        want: Callable[[int | None, dict[str, Any]], bool],
    ) -> tuple[bool, int | None, dict[str, Any]]:
        """Poll the slot's /readyz until ``want(status, body)``; (met?, last status, body)."""
        last: tuple[int | None, dict[str, Any]] = (None, {})

        async def met() -> bool:
            nonlocal last
            last = await self.ready(slot)
            return want(*last)

        return await eventually(met, timeout), last[0], last[1]

    async def stop(self, grace: float) -> None:
        """SIGTERM every process, SIGKILL what outlives ``grace``; stop supervising."""
        for slot in self.slots:
            slot.keep_running = False
            slot.restarts_allowed.set()  # a held slot's task ends instead of waiting
        for slot in self.slots:
            if slot.running and slot.proc is not None:
                slot.term_sent = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGTERM)
        tasks = [s.task for s in self.slots if s.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:
                for slot in self.slots:
                    if slot.running and slot.proc is not None:
                        slot.killed = True
                        with contextlib.suppress(ProcessLookupError):
                            slot.proc.kill()
                await asyncio.wait(tasks, timeout=30)
            for task in tasks:
                if not task.done():
                    task.cancel()


# ------------------------------------------------------------------------------ fleet


@dataclass
class PublishRun:
    code: int | None  # None: killed at the deadline
    started: float
    seconds: float


class Fleet:
    """One test's ledger, consumers, publish loop and partner (see the module doc)."""

    def __init__(
        self,
        settings: Settings,
        partner: RunningPartner,
        log_dir: Path,
        *,
        ledger_url: str | None = None,
        env: Mapping[str, str] | None = None,
        publish_every: float = 3.0,
        publish_deadline: float = 30.0,
        broker: RabbitNode | None = None,
        partner_delay: float = 2.5,
    ) -> None:
        self.settings = settings
        self.broker = broker
        # The partner answers /hooks/drain after partner_delay seconds, which paces the
        # drain (about prefetch x consumers / delay per second: 160/s with the defaults)
        # so a fault lands in the middle of it, with a full prefetch held by each consumer.
        partner.state.rules.setdefault("drain", partner_mod.PathRule(delay_seconds=partner_delay))
        self.partner = partner
        self.log_dir = log_dir
        self.ledger = Ledger(ledger_url or settings.database_url.get_secret_value())
        self.env = {**FAULT_ENV, **(env or {})}
        self.publish_every = publish_every
        self.publish_deadline = publish_deadline
        self.t0 = time.monotonic()
        self.timeline: list[tuple[float, str]] = []
        self.supervisor = Supervisor(settings, log_dir, self.env, note=self.note)
        self.publish_runs: list[PublishRun] = []
        self.rows = 0
        self._publisher: asyncio.Task[None] | None = None
        self._publish_run = asyncio.Lock()  # held by each run; publish_paused() takes it

    # -- bookkeeping

    def note(self, event: str, at: float | None = None) -> float:
        """Record an event on the fleet's timeline (now, or at monotonic time ``at``, e.g.
        read from a server's log); return its monotonic time."""
        when = time.monotonic() if at is None else at
        self.timeline.append((when - self.t0, event))
        self.timeline.sort(key=lambda item: item[0])
        return when

    def describe(self) -> str:
        lines = [f"  {t:7.2f} s  {event}" for t, event in self.timeline]
        codes = [r.code for r in self.publish_runs]
        lines.append(f"  publish runs: {len(codes)}, exit codes {codes}")
        lines.append(f"  consumer logs: {self.log_dir}/consumer-*.log")
        return "timeline:\n" + "\n".join(lines)

    @property
    def amqp_url(self) -> str:
        return self.settings.amqp_url.get_secret_value()

    @property
    def namespace(self) -> str:
        return self.settings.amqp_namespace

    @property
    def sigterm_bound(self) -> float:
        return self.settings.shutdown_grace_seconds + SIGTERM_MARGIN

    # -- setting up

    async def prepare(self, rows: int, path: Callable[[int], str] = lambda _: "drain") -> None:
        """Migrate, load ``rows`` one-shot webhook reminders due now (reminder ``i`` goes to
        ``/hooks/<path(i)>`` of the partner), and publish them all once."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        direct = self.settings.model_copy(
            update={"database_url": SecretStr(self.ledger.url)}  # setup bypasses any proxy
        )
        migrated = await rs.relay(direct, "migrate", timeout=120)
        assert migrated.code == 0, migrated.stdout + migrated.stderr[-2000:]
        pool = await db.create_pool(direct, size=2)
        try:
            loaded = await rs.load(
                pool, [rs.line(f"r{i}", self.partner.url(path(i))) for i in range(rows)]
            )
        finally:
            await pool.close()
        assert loaded == rows, loaded
        published = await rs.relay(direct, "publish", timeout=120)
        assert published.code == 0, published.stdout + published.stderr[-2000:]
        queued = await self.ledger.count("queued")
        assert queued == rows, f"{queued} of {rows} queued after the first publish run"
        self.rows = rows
        self.note(f"{rows} deliveries queued")

    async def start_consumers(
        self, n: int, *, hold_restarts: bool = False, **env: str
    ) -> list[Slot]:
        return [await self.supervisor.add(hold_restarts=hold_restarts, **env) for _ in range(n)]

    def start_publish_loop(self) -> None:
        """``relay publish`` every ``publish_every`` seconds, as the CronJob."""
        if self._publisher is None:
            self._publisher = asyncio.create_task(self._publish_loop())

    @contextlib.asynccontextmanager
    async def publish_paused(self) -> AsyncIterator[None]:
        """No publish run starts inside the block (one under way finishes first)."""
        async with self._publish_run:
            yield

    async def _publish_loop(self) -> None:
        while True:
            async with self._publish_run:
                began = time.monotonic()
                await self._publish_once()
            await asyncio.sleep(max(0.0, began + self.publish_every - time.monotonic()))

    async def _publish_once(self) -> None:
        began = time.monotonic()
        with open(self.log_dir / "publish.log", "ab") as log:  # the child keeps a copy
            proc = await forked.spawn(
                ["publish"], rs.env_for(self.settings, **self.env), stderr=log
            )
        code: int | None
        try:
            code = await asyncio.wait_for(proc.wait(), self.publish_deadline)
        except TimeoutError:
            proc.kill()  # activeDeadlineSeconds
            await proc.wait()
            code = None
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        self.publish_runs.append(PublishRun(code, began - self.t0, time.monotonic() - began))

    async def stop(self) -> None:
        """Stop the publish loop, SIGTERM every consumer (SIGKILL past the bound).
        Safe to call again."""
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
            self._publisher = None
        await self.supervisor.stop(self.sigterm_bound)

    # -- watching

    async def redeliveries(self) -> int:
        """The broker's count of redelivered messages so far (needs a throwaway node)."""
        assert self.broker is not None, "Fleet(broker=...) is needed to read broker counters"
        return await asyncio.to_thread(self.broker.quorum_counter, "messages_redelivered_total")

    async def delivered(self) -> int:
        return await self.ledger.count("delivered")

    async def wait_delivered(self, at_least: int, timeout: float) -> None:
        """Wait until ``at_least`` rows are delivered (the drain is under way)."""

        async def enough() -> bool:
            return await self.delivered() >= at_least

        assert await eventually(enough, timeout), (
            f"only {await self.delivered()} of {at_least} delivered within {timeout} s\n"
            + self.describe()
        )
        self.note(f">= {at_least} delivered")

    async def all_final(self) -> bool:
        states = await self.ledger.states()
        return sum(n for s, n in states.items() if s in FINAL_STATES) == self.rows

    # -- the facts every fault test checks

    async def expect_all_delivered(self, facts: Facts, within: float, since: float) -> None:
        """Every row final within ``within`` seconds of ``since`` (monotonic), all delivered."""
        left = since + within - time.monotonic()
        if await eventually(self.all_final, max(0.0, left)):
            self.note(f"all {self.rows} final")
        else:
            facts.fail(
                f"not every row final within {within:.0f} s of the server's return: "
                f"{await self.ledger.states()}"
            )
        states = await self.ledger.states()
        facts.check(
            states == {"delivered": self.rows},
            f"expected all {self.rows} delivered, ledger says {states}",
        )

    async def expect_dead_letters_only_for_dead_rows(self, facts: Facts) -> list[DeadLetter]:
        letters = await dead_letters(self.amqp_url, self.namespace)
        ids = [d.delivery_id for d in letters if d.delivery_id is not None]
        states = await self.ledger.states_of(ids) if ids else {}
        wrong: dict[tuple[str, str], int] = {}
        for letter in letters:
            state = states.get(letter.delivery_id or 0, "no such row")
            if state != "dead":
                wrong[(state, letter.reason)] = wrong.get((state, letter.reason), 0) + 1
        facts.check(
            not wrong,
            f"{sum(wrong.values())} dead letters for rows that are not dead "
            f"(row state, reason -> count): {wrong}",
        )
        return letters

    async def expect_one_event_per_key(self, facts: Facts) -> None:
        rows = await self.ledger.rows()
        keys = {r["idempotency_key"] for r in rows}
        accepted = set(self.partner.state.accepted)
        missing = keys - accepted
        unknown = accepted - keys
        facts.check(not missing, f"{len(missing)} keys never accepted by the partner")
        facts.check(not unknown, f"partner accepted {len(unknown)} keys that are not rows")
        facts.check(
            self.partner.state.logical_events == len(keys),
            f"partner counted {self.partner.state.logical_events} logical events "
            f"for {len(keys)} keys",
        )

    def expect_sigterms_within_bound(self, facts: Facts) -> None:
        for record in self.supervisor.exits:
            if record.sigterm_seconds is None:
                continue
            facts.check(
                not record.killed
                and record.sigterm_seconds <= self.sigterm_bound
                and record.code == 0,
                f"{record}: a SIGTERM must end with exit 0 within RELAY_SHUTDOWN_GRACE_SECONDS"
                f" + {SIGTERM_MARGIN:.0f} s = {self.sigterm_bound:.0f} s",
            )

    def unrequested_exits(self) -> list[Exit]:
        return [e for e in self.supervisor.exits if not e.requested]

    async def finish(self, facts: Facts) -> None:
        """Stop the fleet (every consumer SIGTERMed, as at the end of a rollout), then:
        dead letters only for dead rows, one logical event per key, and every SIGTERM of
        the test, these included, ended with exit 0 within the grace bound."""
        await self.stop()
        await self.expect_dead_letters_only_for_dead_rows(facts)
        await self.expect_one_event_per_key(facts)
        self.expect_sigterms_within_bound(facts)


class Facts:
    """Collects broken facts so a failing test names all of them, with the timeline."""

    def __init__(self, fleet: Fleet | None = None) -> None:
        self.fleet = fleet
        self.problems: list[str] = []

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.fail(message)
        return ok

    def fail(self, message: str) -> None:
        self.problems.append(message)
        if self.fleet is not None:
            self.fleet.note(f"FACT BROKEN: {message}")

    def assert_all(self) -> None:
        if self.problems:
            tail = "\n" + self.fleet.describe() if self.fleet is not None else ""
            raise AssertionError(
                f"{len(self.problems)} fact(s) broken:\n- " + "\n- ".join(self.problems) + tail
            )


@asynccontextmanager
async def start_drain(
    settings: Settings,
    partner: RunningPartner,
    log_dir: Path,
    *,
    rows: int = 3000,
    consumers: int = 2,
    ledger_url: str | None = None,
    env: Mapping[str, str] | None = None,
    path: Callable[[int], str] = lambda _: "drain",
    partner_delay: float = 2.5,
    publish_every: float = 3.0,
    broker: RabbitNode | None = None,
) -> AsyncIterator[Fleet]:
    """A running drain: rows queued, ``consumers`` supervised, the publish loop on.
    Everything it started is stopped on exit, whatever happened."""
    fleet = Fleet(
        settings,
        partner,
        log_dir,
        ledger_url=ledger_url,
        env=env,
        publish_every=publish_every,
        broker=broker,
        partner_delay=partner_delay,
    )
    try:
        await fleet.prepare(rows, path)
        await fleet.start_consumers(consumers)
        fleet.start_publish_loop()
        yield fleet
    finally:
        await fleet.stop()
        print(fleet.describe())  # shown by pytest with the failure, or with -s
