"""Smoke tests for tests.support.nodes: throwaway servers start, die and come back; a
start survives a pid file read half-written, and one that fails is retried once, then
says why (the server's log) and leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import aio_pika
import asyncpg
import pytest

from tests.support.nodes import (
    NodeError,
    accepts_tcp,
    free_port,
    free_ports,
    start_postgres,
    start_rabbitmq,
)

pytestmark = pytest.mark.fault


def _wait_refused(port: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while accepts_tcp(port, timeout=0.5):
        assert time.monotonic() < deadline, f"port {port} still accepts after the kill"
        time.sleep(0.05)


async def _pg_roundtrip(url: str) -> int:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return int(await conn.fetchval("select 41 + 1"))
    finally:
        await conn.close()


async def _amqp_roundtrip(url: str) -> bytes:
    conn = await aio_pika.connect(url, timeout=10)
    async with conn:
        channel = await conn.channel()
        queue = await channel.declare_queue(exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"ping"), routing_key=queue.name)
        message = await queue.get(timeout=5)
        await message.ack()
        return message.body


def test_postgres_node_kill_and_restart(tmp_path: Path) -> None:
    node = start_postgres(tmp_path, free_port())
    try:
        assert accepts_tcp(node.port)
        assert asyncio.run(_pg_roundtrip(node.url)) == 42

        old_pid = node.pid
        node.kill()
        assert not node.running
        _wait_refused(node.port)

        node.restart()  # crash recovery on the same data directory and port
        assert node.running and node.pid != old_pid
        assert asyncio.run(_pg_roundtrip(node.url)) == 42
    finally:
        node.cleanup()
    assert not node.running and not accepts_tcp(node.port)


def _node_processes(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (scripts/services tags a RabbitMQ node's
    processes with RELAY_RABBIT_NODE=DIR) or whose working directory is ``marker`` (every
    process of a PostgreSQL cluster runs in its data directory)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cwd = os.readlink(proc / "cwd").removesuffix(" (deleted)")
            environ = (proc / "environ").read_bytes().split(b"\0")
            if cwd == marker or marker.encode() in environ:
                found.append(int(proc.name))
    return found


class _EmptyPidFileKeeper(threading.Thread):
    """Recreates a pid file empty whenever it is missing (never truncating one), until it
    holds something: the moment a booting node has created its pid file and not yet
    written it, stretched from microseconds to the whole boot before the node's write."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.created = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                self.created += 1
            with contextlib.suppress(OSError):
                if self.path.stat().st_size > 0:
                    return
            time.sleep(0.001)


def test_rabbitmq_node_started_behind_an_empty_pid_file_is_killed_and_restarted(
    tmp_path: Path,
) -> None:
    """One node (a boot is ~5 CPU-s): its start survives a pid file that stays empty for
    the whole boot, then it is SIGKILLed and comes back on the same data."""
    port, dist_port = free_ports(2)
    node_dir = tmp_path / f"rabbit-{port}"
    node_dir.mkdir()
    keeper = _EmptyPidFileKeeper(node_dir / "rabbitmq.pid")
    keeper.start()
    try:
        node = start_rabbitmq(tmp_path, port, dist_port)  # rabbitmq-server wrote it at last
    finally:
        keeper.done.set()
        keeper.join()
    try:
        assert keeper.created >= 1, "the empty pid file was never staged"
        assert (node_dir / "rabbitmq.pid").read_text().strip() == str(node.pid)
        assert accepts_tcp(node.port)
        assert asyncio.run(_amqp_roundtrip(node.url)) == b"ping"

        old_pid = node.pid
        node.kill()
        assert not node.running
        _wait_refused(node.port)

        node.restart()
        assert node.running and node.pid != old_pid
        assert asyncio.run(_amqp_roundtrip(node.url)) == b"ping"
    finally:
        node.cleanup()
    assert not node.running and not accepts_tcp(node.port)


def test_rabbitmq_node_whose_port_is_taken_is_retried_once_then_leaves_nothing(
    tmp_path: Path,
) -> None:
    port, dist_port = free_ports(2)
    marker = f"RELAY_RABBIT_NODE={os.path.realpath(tmp_path / f'rabbit-{port}')}"
    with socket.socket() as taken:  # bound, not listening: the node's own bind fails
        taken.bind(("127.0.0.1", port))
        with pytest.raises(NodeError) as failed:
            start_rabbitmq(tmp_path, port, dist_port)
    said = str(failed.value)
    assert said.count("did not start; retrying once") == 1, said
    assert "eaddrinuse" in said and "(last 20 lines)" in said, said  # the node's log tail
    assert _node_processes(marker) == []
    listening = [p for p in (port, dist_port) if accepts_tcp(p)]
    # Once seen under two suites at once (the distribution port accepting, no process of
    # this node left): say who listens, for the next look.
    assert listening == [], _listeners(listening)


def _listeners(ports: list[int]) -> str:
    """Who listens on ``ports`` (``ss``), and those processes' command lines."""
    try:
        out = subprocess.run(
            ["ss", "-ltnpH", " or ".join(f"sport = :{p}" for p in ports)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except OSError as exc:
        return f"ports {ports} accept connections (ss: {exc})"
    for pid in re.findall(r"pid=(\d+)", out):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            out += f"\n{pid}: {cmdline.decode(errors='replace')[:600]}"
    return out


def test_rabbitmq_node_with_a_broken_cookie_fails_saying_why_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    port, dist_port = free_ports(2)
    node_dir = tmp_path / f"rabbit-{port}"
    (node_dir / "home").mkdir(parents=True)
    cookie = node_dir / "home" / ".erlang.cookie"
    cookie.write_text("not-private")
    cookie.chmod(0o644)  # Erlang refuses a cookie others may read
    with pytest.raises(NodeError) as failed:
        start_rabbitmq(tmp_path, port, dist_port)
    said = str(failed.value)
    assert "must be accessible by owner only" in said, said  # from the VM's crash dump
    assert _node_processes(f"RELAY_RABBIT_NODE={os.path.realpath(node_dir)}") == []


def test_postgres_node_whose_port_is_taken_is_retried_once_then_leaves_nothing(
    tmp_path: Path,
) -> None:
    port = free_port()
    with socket.socket() as taken:  # bound, not listening: the postmaster's bind fails
        taken.bind(("127.0.0.1", port))
        with pytest.raises(NodeError) as failed:
            start_postgres(tmp_path, port)
    said = str(failed.value)
    assert said.count("did not start in") == 2 and "retrying once" in said, said
    assert "could not bind" in said and "Address already in use" in said, said  # log tail
    data = os.path.realpath(tmp_path / f"pg-{port}" / "data")
    assert _node_processes(data) == []
    assert not accepts_tcp(port)
