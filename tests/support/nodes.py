"""Throwaway PostgreSQL and RabbitMQ nodes for fault tests.

Each node is a real server process started through ``scripts/services``
(``pg-node`` / ``rabbit-node``), with its own directory and ports, so a test
may SIGKILL it and start it again without touching the machine's shared
servers::

    node = start_postgres(tmp_path, free_port())
    try:
        ...                      # connect to node.url
        node.kill()              # crash: SIGKILL the postmaster
        node.restart()           # same data directory, same port
    finally:
        node.cleanup()

Only the standard library is used. Servers are stopped at interpreter exit
if a test forgot to, so a failing test does not leave them running.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import pwd
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICES = REPO_ROOT / "scripts" / "services"
# Where PostgreSQL data goes when the caller's directory is private to root
# (pytest's tmp_path is 0700): the postgres user must be able to reach it.
NODES_BASE = Path(os.environ.get("RELAY_SERVICES_DIR", "/tmp/reminder-relay-services")) / "nodes"

# Ports recently handed out to any test process on this machine (see free_ports).
PORTS_FILE = NODES_BASE.parent / "ports-handed-out"
_PORT_QUARANTINE_SECONDS = 600.0

RABBITMQCTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"

START_TIMEOUT = 180.0
STOP_TIMEOUT = 120.0


class NodeError(RuntimeError):
    """``scripts/services`` failed to start or stop a node."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct free ports (held open together while chosen).

    Test processes run side by side (pytest-xdist workers, two suites at once), and a
    port is free from the moment it is chosen until the node binds it seconds later:
    every port handed out is noted in a file shared by all of them (under a lock) and
    not handed out again for ``_PORT_QUARANTINE_SECONDS``.
    """
    PORTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(PORTS_FILE, "a+", encoding="ascii") as book:
        fcntl.flock(book, fcntl.LOCK_EX)  # released when the file closes
        book.seek(0)
        now = time.time()
        recent = {}
        for line in book.read().split():
            port, _, at = line.partition("@")
            if port.isdigit() and _is_float(at) and now - float(at) < _PORT_QUARANTINE_SECONDS:
                recent[int(port)] = float(at)
        ports = _unbound_ports(count, avoid=set(recent))
        recent.update(dict.fromkeys(ports, now))
        book.seek(0)
        book.truncate()
        book.write("".join(f"{port}@{at:.0f}\n" for port, at in recent.items()))
        return ports


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _ports_to_choose_from() -> range:
    """Ports below the kernel's ephemeral range. One the kernel hands out (for a bind to
    port 0, or as an outgoing connection's own port) could be taken by any process while
    the node that owns it is down between a kill and its restart: a cluster node's restart
    found its port taken so. Below that range only ``free_ports`` hands ports out."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(20000, 32000) if low < 12288 else range(low - 12000, low)


_choose = random.SystemRandom()  # not the global generator, which tests may seed


def _unbound_ports(count: int, *, avoid: set[int]) -> list[int]:
    """``count`` ports that nothing has bound on 127.0.0.1 now, none in ``avoid``."""
    candidates = _ports_to_choose_from()
    ports: list[int] = []
    while len(ports) < count:
        port = _choose.choice(candidates)
        if port in avoid or port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # bound by something else
        ports.append(port)
    return ports


def accepts_tcp(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> bool:
    """True if ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie.

    Killed servers are daemons re-parented to pid 1, which may reap them late;
    a zombie still answers ``kill(pid, 0)`` but is dead for our purposes.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _run_services(*args: str | Path, timeout: float) -> str:
    """Run ``scripts/services ARGS``; return its stdout or raise NodeError (with the tail
    of its stderr: the server logs a failed start shows)."""
    cmd = [str(SERVICES), *(str(a) for a in args)]
    # Its own session, so a timeout ends the script's helpers (rabbitmqctl) with it.
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise NodeError(f"{' '.join(cmd)} timed out after {timeout:.0f} s") from exc
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-60:])
        raise NodeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return stdout


def _last_line_pid(stdout: str) -> int:
    lines = stdout.strip().splitlines()
    if not lines or not lines[-1].strip().isdigit():
        raise NodeError(f"scripts/services printed no pid: {stdout!r}")
    return int(lines[-1])


@dataclass
class _Node:
    """A server process managed by ``scripts/services <kind> start|stop DIR``."""

    dir: Path
    port: int
    pid: int = 0
    #: Seconds the last start took (until it accepted connections).
    last_start_seconds: float = 0.0
    _kind: str = field(default="", init=False, repr=False)

    def _start_args(self) -> list[str | Path]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        """True while the server's OS process is alive."""
        return self.pid > 0 and pid_alive(self.pid)

    def start(self) -> None:
        """Start the server (a no-op if it runs) and wait until it is ready.

        ``scripts/services`` retries a failed start once and leaves nothing running after
        a second failure; should it itself be cut short (a timeout), what it started is
        stopped here before the error is raised."""
        began = time.monotonic()
        try:
            out = _run_services(self._kind, "start", *self._start_args(), timeout=START_TIMEOUT)
        except NodeError:
            with contextlib.suppress(NodeError):
                self.stop()
            raise
        self.pid = _last_line_pid(out)
        self.last_start_seconds = time.monotonic() - began

    def stop(self) -> None:
        """Stop cleanly; after a kill, clean up what the dead server left."""
        _run_services(self._kind, "stop", self.dir, timeout=STOP_TIMEOUT)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the server's OS process and wait until it is gone."""
        if not self.running:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while pid_alive(self.pid):
            if time.monotonic() > deadline:
                raise NodeError(f"pid {self.pid} survived SIGKILL for {timeout} s")
            time.sleep(0.02)

    def restart(self) -> None:
        """Start again on the same directory and port (stopping it first if running)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        """Stop the server if it runs. Subclasses also remove out-of-tree data."""
        if self.running or self.dir.exists():
            self.stop()

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.cleanup()

    def __enter__(self) -> _Node:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


@dataclass
class PostgresNode(_Node):
    """A throwaway PostgreSQL cluster: superuser ``postgres``, trust auth, 127.0.0.1 only."""

    #: Data kept outside the caller's directory (see NODES_BASE); removed by cleanup().
    owned_dir: Path | None = None

    def __post_init__(self) -> None:
        self._kind = "pg-node"

    def _start_args(self) -> list[str | Path]:
        return [self.dir, str(self.port)]

    @property
    def url(self) -> str:
        """asyncpg-style URL of the ``postgres`` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def cleanup(self) -> None:
        """Stop the cluster and remove data kept outside the caller's directory."""
        super().cleanup()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
            self.owned_dir = None


@dataclass
class RabbitNode(_Node):
    """A throwaway RabbitMQ node named ``relaytest<PORT>@localhost`` (guest/guest)."""

    dist_port: int = 0

    def __post_init__(self) -> None:
        self._kind = "rabbit-node"

    def _start_args(self) -> list[str | Path]:
        return [self.dir, str(self.port), str(self.dist_port)]

    @property
    def url(self) -> str:
        """AMQP URL of the default vhost as guest (allowed from 127.0.0.1)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def node_name(self) -> str:
        """The Erlang node name, for rabbitmqctl ``-n``."""
        return f"relaytest{self.port}@localhost"

    @property
    def log_file(self) -> Path:
        """The node's own log (channel exceptions, consumer timeouts, ...)."""
        return self.dir / "log" / f"{self.node_name}.log"

    def ctl(self, *args: str, timeout: float = 120.0) -> str:
        """Run ``rabbitmqctl ARGS`` against this node; return stdout or raise NodeError.
        (120 s: each call boots an Erlang VM, which took over 60 s under two suites.)

        The real CLI (not Debian's wrapper, which switches to the rabbitmq user's cookie)
        with this node's HOME, where its cookie lives.
        """
        cmd = [RABBITMQCTL, "-n", self.node_name, "-q", *args]
        what = f"rabbitmqctl {' '.join(args)}"
        env = {**os.environ, "HOME": str(self.dir / "home")}
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise NodeError(f"{what} timed out after {timeout:.0f} s") from exc
        if proc.returncode != 0:
            raise NodeError(f"{what} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        return proc.stdout.strip()

    def set_env(self, key: str, value: int) -> None:
        """Set a ``rabbit`` application setting at run time (``rabbitmqctl eval``).

        Some settings are read when a channel opens (``consumer_timeout``), others on
        every channel tick (``channel_tick_interval``). Never unset one the broker reads
        with a match on ``{ok, _}``: restore the value ``get_env`` returned instead.
        """
        if not key.isidentifier():
            raise ValueError(f"not an application setting: {key!r}")
        out = self.ctl("eval", f"application:set_env(rabbit, {key}, {int(value)}).")
        if out != "ok":
            raise NodeError(f"set_env {key}: {out}")

    def consumer_channels(self, queue: str) -> set[str]:
        """Pids of the channels consuming from ``queue`` right now."""
        out = self.ctl("list_consumers", "queue_name", "channel_pid", "--no-table-headers")
        rows = (line.split("\t") for line in out.splitlines() if "\t" in line)
        return {pid for name, pid in rows if name == queue}

    def quorum_counter(self, name: str) -> int:
        """A node-wide counter of AMQP 0-9-1 deliveries from quorum queues, e.g.
        ``messages_redelivered_total``: deliveries of a message delivered before (each
        one moves it toward ``x-delivery-limit``). Node-wide: only meaningful while one
        test at a time uses the node."""
        if not name.isidentifier():
            raise ValueError(f"not a counter: {name!r}")
        out = self.ctl(
            "eval",
            f"maps:get({name}, maps:get([{{protocol,amqp091}},{{queue_type,rabbit_quorum_queue}}],"
            " rabbit_global_counters:overview())).",
        )
        return int(out)

    def get_env(self, key: str) -> int:
        """The current integer value of a ``rabbit`` application setting."""
        if not key.isidentifier():
            raise ValueError(f"not an application setting: {key!r}")
        out = self.ctl("eval", f"{{ok, V}} = application:get_env(rabbit, {key}), V.")
        return int(out)


def _postgres_can_enter(path: Path) -> bool:
    """True if the postgres user can traverse every existing directory down to ``path``."""
    if os.geteuid() != 0:
        return True  # the cluster then runs as the current user
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        return True  # scripts/services reports the missing package clearly
    groups = set(os.getgrouplist("postgres", pw.pw_gid))
    for p in [path, *path.parents]:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue  # created later by scripts/services, searchable
        if st.st_uid == pw.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return False
    return True


def _ensure_public_dir(path: Path) -> None:
    for p in reversed([path, *path.parents]):
        if not p.exists():
            p.mkdir()
            p.chmod(0o755)


_N = TypeVar("_N", bound=_Node)


def _started(node: _N) -> _N:
    """``node`` started, and stopped at interpreter exit; on a failed start, cleaned up."""
    atexit.register(node._at_exit)
    try:
        node.start()
    except BaseException:
        node.cleanup()
        raise
    return node


def start_postgres(tmp_dir: Path, port: int) -> PostgresNode:
    """Start a throwaway PostgreSQL 15 cluster on 127.0.0.1:``port``.

    Its data lives in ``tmp_dir/pg-PORT``, or, when the postgres user cannot
    reach ``tmp_dir`` (pytest's tmp_path is private to root), in a fresh
    directory under NODES_BASE that ``tmp_dir/pg-PORT`` links to and that
    ``cleanup()`` (or interpreter exit) removes.
    """
    link = Path(tmp_dir) / f"pg-{port}"
    owned: Path | None = None
    if _postgres_can_enter(link):
        node_dir = link
    else:
        _ensure_public_dir(NODES_BASE)
        owned = Path(tempfile.mkdtemp(prefix=f"pg-{port}-", dir=NODES_BASE))
        node_dir = owned
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(owned, target_is_directory=True)
    return _started(PostgresNode(dir=node_dir, port=port, owned_dir=owned))


def start_rabbitmq(tmp_dir: Path, port: int, dist_port: int) -> RabbitNode:
    """Start a throwaway RabbitMQ node on 127.0.0.1:``port`` (Erlang distribution on ``dist_port``).

    It runs beside any other node (own name, cookie, directories in
    ``tmp_dir/rabbit-PORT``), and with the dead-letter publisher confirm
    timeout at 1 s, as the project's tests expect.
    """
    return _started(
        RabbitNode(dir=Path(tmp_dir) / f"rabbit-{port}", port=port, dist_port=dist_port)
    )
