"""tests.support.proxy against a real echo server: pass, hang, cut, and pass again."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.support import relay as rs
from tests.support.proxy import Mode, ProxyThread

pytestmark = pytest.mark.timeout(60)

# A hang is shown by absence: this long without a byte (the proxy forwards in microseconds).
SILENCE = 1.0


class Echo:
    """An echo server on 127.0.0.1 that counts its open connections."""

    def __init__(self) -> None:
        self.open = 0
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.accepted += 1
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            self.open -= 1
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)


async def _read(reader: asyncio.StreamReader, n: int, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), timeout)


async def _silent(reader: asyncio.StreamReader) -> bool:
    """True if nothing arrives for SILENCE seconds."""
    try:
        await asyncio.wait_for(reader.read(1), SILENCE)
    except TimeoutError:
        return True
    return False


async def _closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True if the connection ends (EOF or reset) within 5 s."""
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except (ConnectionError, OSError):
        return True


async def test_proxy_passes_hangs_cuts_and_passes_again() -> None:
    echo = Echo()
    echo_port = await echo.start()
    proxy = ProxyThread(echo_port)
    writers: list[asyncio.StreamWriter] = []
    try:
        port = await asyncio.to_thread(proxy.start)

        r1, w1 = await _connect(port)
        writers.append(w1)
        w1.write(b"a")
        assert await _read(r1, 1) == b"a"

        # hang: the open connection gets nothing back; a new one is accepted, but
        # does not even reach the server.
        await asyncio.to_thread(proxy.hang)
        assert proxy.mode is Mode.HANG
        w1.write(b"b")
        assert await _silent(r1)
        r2, w2 = await _connect(port)
        writers.append(w2)
        w2.write(b"c")
        assert await _silent(r2)
        assert echo.accepted == 1

        # pass: what was held flows on, both ways, on both connections.
        await asyncio.to_thread(proxy.pass_)
        assert await _read(r1, 1) == b"b"
        assert await _read(r2, 1) == b"c"
        assert echo.accepted == 2

        # cut: every connection ends, on both sides; a new one ends at once.
        await asyncio.to_thread(proxy.cut)
        assert await _closed_by_peer(r1)
        assert await _closed_by_peer(r2)

        async def server_side_closed() -> bool:
            return echo.open == 0

        await rs.wait_for(server_side_closed, 5, "the server's side of the cut connections closed")
        try:
            r3, w3 = await _connect(port)
            writers.append(w3)
            assert await _closed_by_peer(r3)
        except (ConnectionError, OSError):
            pass  # refused outright: also a server that is gone
        assert echo.accepted == 2
        assert proxy.open_connections == 0

        # pass again: new connections work.
        await asyncio.to_thread(proxy.pass_)
        r4, w4 = await _connect(port)
        writers.append(w4)
        w4.write(b"d")
        assert await _read(r4, 1) == b"d"
    finally:
        for w in writers:
            w.transport.abort()
        await asyncio.to_thread(proxy.close)
        with contextlib.suppress(Exception):
            await echo.close()
