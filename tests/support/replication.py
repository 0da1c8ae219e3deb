"""Servers made of several throwaway nodes: a RabbitMQ cluster and a PostgreSQL standby.

Each step waits on a fact the server states once it holds (``rabbit:start()`` returning
in a node's join, ``rabbitmqctl await_online_nodes``; ``pg_stat_wal_receiver`` saying
``streaming``), never on a file or a port alone. A step that fails for what may be a
passing reason (a peer still loading its tables, a base backup cut short) is retried once,
with the server's log on stderr; a second failure raises NodeError with it, and a
half-made standby is removed::

    nodes = start_cluster(base, 3)     # three fresh nodes joined into one cluster
    join_cluster(node, seed)           # node joins seed's cluster (same Erlang cookie)
    await_cluster(seed, members=3)     # until seed sees three running nodes
    standby = start_standby(primary)   # a streaming standby on a port of its own
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.nodes import (
    NODES_BASE,
    START_TIMEOUT,
    NodeError,
    PostgresNode,
    RabbitNode,
    _ensure_public_dir,
    free_port,
    free_ports,
)

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _log_tail(log: Path, lines: int = 20) -> str:
    """The last lines of a server's log (what a failed step left to read)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({log} unreadable: {exc})"


def start_cluster(base: Path, size: int) -> list[RabbitNode]:
    """``size`` throwaway RabbitMQ nodes under ``base`` (own ports, directories and one
    shared Erlang cookie), started at once and joined into one cluster; none is left
    running if that fails."""
    ports = free_ports(2 * size)
    cookie = secrets.token_hex(20)
    nodes = [
        RabbitNode(base / f"rabbit-{p}", p, dist_port=d)
        for p, d in zip(ports[::2], ports[1::2], strict=True)
    ]
    for node in nodes:
        home = node.dir / "home"
        home.mkdir(parents=True)
        (home / ".erlang.cookie").write_text(cookie)
        (home / ".erlang.cookie").chmod(0o400)
    try:
        with ThreadPoolExecutor(size) as pool:
            list(pool.map(RabbitNode.start, nodes))
        for node in nodes[1:]:
            join_cluster(node, nodes[0])
        await_cluster(nodes[0], size)
    except BaseException:
        stop_cluster(nodes)
        raise
    return nodes


def stop_cluster(nodes: list[RabbitNode]) -> None:
    """Stop every node and remove its directory, whatever state each is in."""
    for node in nodes:
        with contextlib.suppress(Exception):
            node.cleanup()


def join_cluster(node: RabbitNode, seed: RabbitNode) -> None:
    """Make ``node`` a member of ``seed``'s cluster; return once its rabbit application
    runs again (``rabbit:start()`` returned). The two must share an Erlang cookie."""
    for attempt in (1, 2):
        # What `rabbitmqctl stop_app`, (`reset`,) `join_cluster` and `start_app` call, in
        # one `rabbitmqctl eval`: each CLI run boots an Erlang VM of its own (~0.7 CPU-s).
        # rabbit:start() returns once the application runs (what await_startup waits for).
        # The retry first resets whatever the failed join left.
        reset = "ok = rabbit_mnesia:reset(), " if attempt == 2 else ""
        steps = (
            f"ok = rabbit:stop(), {reset}"
            f"ok = case rabbit_mnesia:join_cluster('{seed.node_name}', disc) of "
            "ok -> ok; {ok, already_member} -> ok; Other -> Other end, "
            "ok = rabbit:start()."
        )
        try:
            node.ctl("eval", steps, timeout=START_TIMEOUT)
            return
        except NodeError as exc:
            failure = (
                f"{node.node_name} joining {seed.node_name}: {exc}\n{_log_tail(node.log_file)}"
            )
            if attempt == 2:
                raise NodeError(failure) from exc
            print(f"{failure}\nretrying the join once", file=sys.stderr)


def await_cluster(node: RabbitNode, members: int, timeout: float = START_TIMEOUT) -> None:
    """Return once ``node`` sees ``members`` running nodes in its cluster."""
    seconds = str(int(timeout))
    node.ctl("await_online_nodes", str(members), "--timeout", seconds, timeout=timeout + 30)


def _as_postgres(
    *args: str | Path, timeout: float = START_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool as the postgres user when we are root (it refuses root)."""
    cmd = [str(a) for a in args]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd="/", stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise NodeError(f"{' '.join(cmd)} timed out after {timeout:.0f} s") from exc


def _base_backup(primary: PostgresNode, data: Path) -> None:
    """``pg_basebackup -R -X stream`` of ``primary`` into ``data``, retried once."""
    for attempt in (1, 2):
        done = _as_postgres(
            PG_BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port),
            "-U", "postgres", "-D", data, "-R", "-X", "stream",
        )  # fmt: skip
        if done.returncode == 0:
            return
        failure = f"pg_basebackup from port {primary.port} exited {done.returncode}: "
        failure += done.stderr.strip()[-1500:]
        if attempt == 2:
            raise NodeError(failure)
        print(f"{failure}\nretrying the base backup once", file=sys.stderr)
        shutil.rmtree(data, ignore_errors=True)  # pg_basebackup wants an empty directory


def promote(standby: PostgresNode) -> None:
    """Promote ``standby`` to a primary; return once it accepts writes (``pg_ctl -w``)."""
    done = _as_postgres(PG_BIN / "pg_ctl", "promote", "-w", "-D", standby.dir / "data")
    if done.returncode != 0:
        raise NodeError(f"pg_ctl promote exited {done.returncode}: {done.stderr.strip()[-1500:]}")


def _receiver_status(node: PostgresNode) -> str:
    done = subprocess.run(
        [PG_BIN / "psql", "-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres",
         "-d", "postgres", "-Atqc", "SELECT status FROM pg_stat_wal_receiver"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    return done.stdout.strip()


def _wait_streaming(standby: PostgresNode, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while (status := _receiver_status(standby)) != "streaming":
        if time.monotonic() > deadline:
            tail = _log_tail(standby.dir / "postgres.log")
            raise NodeError(f"standby on {standby.port} not streaming ({status!r}):\n{tail}")
        time.sleep(0.2)


def start_standby(primary: PostgresNode) -> PostgresNode:
    """A streaming standby of ``primary`` on a port of its own, its data under NODES_BASE;
    returned once it streams from the primary. On failure nothing of it is left."""
    _ensure_public_dir(NODES_BASE)
    owned = Path(tempfile.mkdtemp(prefix="pg-standby-", dir=NODES_BASE))
    if os.geteuid() == 0:
        shutil.chown(owned, "postgres", "postgres")
    standby = PostgresNode(dir=owned, port=free_port(), owned_dir=owned)
    atexit.register(standby._at_exit)
    try:
        _base_backup(primary, owned / "data")
        standby.start()  # scripts/services: retried once, nothing left running on failure
        _wait_streaming(standby)
    except BaseException:
        standby.cleanup()
        raise
    return standby
