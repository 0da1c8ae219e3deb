"""Smoke tests for tests.support.nodes: throwaway servers start, die and come back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aio_pika
import asyncpg
import pytest

from tests.support.nodes import accepts_tcp, free_port, free_ports, start_postgres, start_rabbitmq

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


def test_rabbitmq_node_kill_and_restart(tmp_path: Path) -> None:
    port, dist_port = free_ports(2)
    node = start_rabbitmq(tmp_path, port, dist_port)
    try:
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
