"""Shared helpers of the benchmarks: a throw-away database and broker namespace, the
``relay`` commands as real subprocesses, and per-process resource readings from /proc.

Only 127.0.0.1 traffic. Everything a benchmark creates (database ``relay_bench_*``,
broker namespace ``bench-*``, scratch directory) is removed at the end.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[1]

# A deployed relay runs from compiled bytecode (the image's pip install writes it). With
# PYTHONDONTWRITEBYTECODE set in the shell (some shells and images set it) and a venv
# installed by uv (which writes no .pyc), every process a bench starts would compile each
# module it imports again: ~0.37 CPU-s per `relay publish` start here, which the relay's
# side pays and a yardstick importing only aio-pika barely does. The first run writes them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aio_pika  # noqa: E402
import asyncpg  # noqa: E402

from service import amqp  # noqa: E402
from service.settings import Settings  # noqa: E402

BASE_DB_URL = os.environ.get("RELAY_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("RELAY_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
RELAY = [sys.executable, "-m", "service.ops.cli"]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def db_url(name: str) -> str:
    return urlunsplit(urlsplit(BASE_DB_URL)._replace(path=f"/{name}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------- /proc readings


def proc_status_kb(pid: int, key: str) -> int | None:
    """A ``kB`` field of /proc/<pid>/status (VmHWM = peak RSS, VmRSS = current)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return float(sum(parts) - idle), float(sum(parts))


class CpuCap:
    """A cgroup whose processes together get at most ``cores`` of CPU (the kernel's CFS
    quota): one process made slower on demand, the rest of the machine untouched. Needs
    root and the cgroup ``cpu`` controller (v1 at /sys/fs/cgroup/cpu, or v2); says which
    is missing otherwise. ``add(pid)`` moves a whole process; ``remove()`` after it ended.
    """

    _PERIOD_US = 100_000

    def __init__(self, cores: float) -> None:
        if not 0 < cores <= (os.cpu_count() or 1):
            raise SystemExit(f"--cpu-cap must be above 0 and at most {os.cpu_count()} cores")
        name = f"relay-bench-{os.getpid()}"
        quota = str(round(cores * self._PERIOD_US))
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        try:
            if (v1 / "cpu.cfs_quota_us").exists():
                self.path = v1 / name
                limits = {"cpu.cfs_period_us": str(self._PERIOD_US), "cpu.cfs_quota_us": quota}
            elif "cpu" in (v2 / "cgroup.controllers").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu")
                self.path = v2 / name
                limits = {"cpu.max": f"{quota} {self._PERIOD_US}"}
            else:
                raise SystemExit("--cpu-cap: the cgroup v2 hierarchy has no cpu controller")
            self.path.mkdir()
        except OSError as exc:
            raise SystemExit(f"--cpu-cap needs root and the cgroup cpu controller: {exc}") from exc
        try:
            for file, value in limits.items():
                (self.path / file).write_text(value)
        except OSError as exc:
            self.remove()
            raise SystemExit(f"--cpu-cap: could not set the quota: {exc}") from exc

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Remove the cgroup; its processes must have ended (a live one keeps it)."""
        try:
            self.path.rmdir()
        except OSError as exc:
            print(f"   --cpu-cap: could not remove {self.path}: {exc}", flush=True)


class MachineLoad:
    """Share of all CPUs busy between ``start()`` and ``stop()`` (every process)."""

    def __init__(self) -> None:
        self._start = machine_cpu()
        self.busy = 0.0

    def stop(self) -> float:
        busy, total = machine_cpu()
        self.busy = (busy - self._start[0]) / max(total - self._start[1], 1.0)
        return self.busy


def proc_state(pid: int) -> str | None:
    """The scheduler state letter of a process (R, S, D, ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (command name, CPU seconds so far) of every process on the machine."""
    snapshot: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        snapshot[int(entry)] = (comm, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return snapshot


def cpu_by_group(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    ours: dict[int, str],
) -> dict[str, float]:
    """CPU seconds spent between two snapshots, by our process names, else by command
    name (``postgres`` is every backend, ours and others'; ``beam.smp`` is RabbitMQ)."""
    groups: dict[str, float] = {}
    for pid, (comm, cpu) in after.items():
        spent = cpu - before.get(pid, (comm, 0.0))[1]
        if spent <= 0:
            continue
        name = ours.get(pid) or comm
        groups[name] = groups.get(name, 0.0) + spent
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


class CpuMonitor:
    """CPU seconds of every process between ``start()`` and ``stop()``, sampled every
    ``interval`` s so that processes which exit meanwhile (a publish run and its database
    backends) are counted up to their last sample."""

    def __init__(self, interval: float = 0.25) -> None:
        self._interval = interval
        self._before: dict[int, tuple[str, float]] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ours: dict[int, str] = {os.getpid(): "bench script"}
        self.wall = 0.0
        self._started = 0.0
        # state samples of our processes: R (running or waiting for a CPU) vs S/D (waiting
        # for I/O: database, broker, HTTP); sampled every 20 ms
        self.states: dict[str, dict[str, int]] = {}

    def start(self) -> CpuMonitor:
        self._before = cpu_snapshot()
        self._last = dict(self._before)
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        next_full = time.monotonic()
        while not self._stop.wait(0.02):
            for pid, name in list(self.ours.items()):
                if pid == os.getpid():
                    continue
                state = proc_state(pid)
                if state is not None:
                    counts = self.states.setdefault(name, {})
                    counts[state] = counts.get(state, 0) + 1
            if time.monotonic() >= next_full:
                self._last.update(cpu_snapshot())
                next_full = time.monotonic() + self._interval

    def running_share(self, name: str) -> float:
        """Share of samples in which process ``name`` was runnable (R), not waiting."""
        counts = self.states.get(name, {})
        return counts.get("R", 0) / max(sum(counts.values()), 1)

    def stop(self) -> dict[str, float]:
        """CPU seconds by group (see ``cpu_by_group``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._last.update(cpu_snapshot())
        self.wall = time.monotonic() - self._started
        return cpu_by_group(self._before, self._last, self.ours)


def describe_groups(groups: dict[str, float], wall: float, top: int = 6) -> str:
    """'consumer 12.1 s (0.61 cores), postgres ...' for the biggest groups."""
    shown = list(groups.items())[:top]
    rest = sum(list(groups.values())[top:])
    parts = [f"{name} {cpu:.1f} s ({cpu / wall:.2f} cores)" for name, cpu in shown]
    if rest:
        parts.append(f"other {rest:.1f} s")
    return ", ".join(parts)


@dataclass
class Finished:
    """A finished subprocess: exit code, wall time, peak RSS and CPU (from wait4)."""

    code: int
    wall_seconds: float
    max_rss_kb: int
    cpu_seconds: float
    stdout: str
    stderr_path: Path


def run_measured(
    cmd: Sequence[str],
    env: dict[str, str],
    scratch: Path,
    tag: str,
    monitor: CpuMonitor | None = None,
) -> Finished:
    """Run a command to completion; peak RSS and CPU come from the kernel (wait4)."""
    out_path, err_path = scratch / f"{tag}.out", scratch / f"{tag}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=err)
        if monitor is not None:
            monitor.ours[proc.pid] = tag
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
    return Finished(
        code=proc.returncode,
        wall_seconds=wall,
        max_rss_kb=usage.ru_maxrss,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        stdout=out_path.read_text(),
        stderr_path=err_path,
    )


def check(result: Finished, what: str) -> None:
    if result.code != 0:
        tail = result.stderr_path.read_text()[-2000:]
        raise SystemExit(f"{what} exited {result.code}\nstdout: {result.stdout}\nstderr: {tail}")


# ---------------------------------------------------------------- environment


@dataclass
class BenchEnv:
    """One benchmark run's database, namespace, secret, scratch directory and env."""

    name: str
    database: str
    namespace: str
    secret: str
    scratch: Path
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def database_url(self) -> str:
        return db_url(self.database)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a ``relay`` subprocess for this run."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env.update(
            {
                "RELAY_DATABASE_URL": self.database_url,
                "RELAY_AMQP_URL": AMQP_URL,
                "RELAY_AMQP_NAMESPACE": self.namespace,
                "RELAY_ALLOW_NETWORKS": "127.0.0.0/8",
                "RELAY_WEBHOOK_SIGNING_SECRETS": self.secret,
                "RELAY_HEALTH_PORT": "0",
                "RELAY_STATE_DIR": str(self.scratch),
                "PYTHONPATH": str(REPO),
            }
        )
        env.update(self.extra_env)
        env.update(relay_variables(extra))
        return env


def relay_variables(settings: dict[str, str]) -> dict[str, str]:
    """Settings by name (``prefetch``) as the environment variables (``RELAY_PREFETCH``)."""
    return {f"RELAY_{k.upper()}": v for k, v in settings.items()}


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(BASE_DB_URL)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def delete_namespace(namespace: str) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await amqp.delete_topology(
            channel, amqp.Topology.from_settings(Settings(amqp_namespace=namespace))
        )


@asynccontextmanager
async def bench_env(name: str, keep_scratch: bool = False) -> AsyncIterator[BenchEnv]:
    """A fresh database (``CREATE DATABASE`` + ``relay migrate``) and broker namespace,
    both removed on exit, whatever happens."""
    tag = uuid.uuid4().hex[:8]
    env = BenchEnv(
        name=name,
        database=f"relay_bench_{name}_{tag}",
        namespace=f"bench-{tag}",
        secret="whsec_" + base64.b64encode(secrets.token_bytes(24)).decode(),
        scratch=Path(tempfile.mkdtemp(prefix=f"relay-bench-{name}-")),
    )
    await _admin(f'CREATE DATABASE "{env.database}"')
    try:
        check(run_measured([*RELAY, "migrate"], env.env(), env.scratch, "migrate"), "relay migrate")
        yield env
    finally:
        try:
            await delete_namespace(env.namespace)
        finally:
            await _admin(f'DROP DATABASE IF EXISTS "{env.database}" WITH (FORCE)')
            if keep_scratch:
                print(f"   (logs kept in {env.scratch})")
            else:
                for path in sorted(env.scratch.rglob("*"), reverse=True):
                    path.unlink() if path.is_file() else path.rmdir()
                env.scratch.rmdir()


def write_reminders(path: Path, count: int, destination: str, ahead: float = 0.0) -> None:
    """``count`` one-shot webhook reminders, all due a few seconds ago; with ``ahead`` > 0,
    due evenly over ``ahead`` seconds from 30 s after now instead (a publish run then hands
    them to the timer ladder)."""
    now = datetime.now(UTC)
    start = now + timedelta(seconds=30) if ahead > 0 else now - timedelta(seconds=5)
    with open(path, "w") as f:
        for i in range(count):
            due = (start + timedelta(seconds=ahead * i / count)).isoformat()
            f.write(
                json.dumps(
                    {
                        "id": f"bench-{i:07d}",
                        "channel": "webhook",
                        "destination": destination,
                        "payload": {"text": f"Reminder {i}", "n": i},
                        "due_at": due,
                    }
                )
                + "\n"
            )


async def state_counts(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT state::text AS s, count(*) AS n FROM deliveries GROUP BY 1")
    return {r["s"]: int(r["n"]) for r in rows}


async def queue_depth(namespace: str, lane: str = amqp.BULK) -> int:
    """Messages ready in a lane queue (passive declare)."""
    topology = amqp.Topology.from_settings(Settings(amqp_namespace=namespace))
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(topology.lane_queue(lane), passive=True)
        return int(queue.declaration_result.message_count or 0)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
