"""A small TCP proxy on 127.0.0.1 that fault tests put in front of a server.

Modes (switch at any time, in any order):

- ``pass``: forward bytes both ways.
- ``hang``: keep every connection open and accept new ones, but forward no byte in
  either direction, as with a server that stopped answering or a network path that
  went silent: the peers see open sockets and no answer. Bytes already read but not
  yet written are held, not dropped. Back in ``pass`` everything
  held flows on, as when a stalled server resumes; connections opened during the hang
  reach the upstream server only then.
- ``cut``: abort every connection (both sides get a reset); new connections are
  accepted and aborted at once, like a server that is gone.

It runs on its own event loop in a daemon thread, so a busy or blocked test loop never
changes what it does::

    with ProxyThread(upstream_port) as proxy:
        url = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres"
        ...
        proxy.hang()
        proxy.pass_()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
HOST = "127.0.0.1"
CHUNK = 64 * 1024


class Mode(enum.Enum):
    PASS = "pass"
    HANG = "hang"
    CUT = "cut"


class _Link:
    """One client connection and, once forwarding began, its upstream connection."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    def close(self) -> None:
        """Abort both sides (the peers see a reset)."""
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()

    def abort(self) -> None:
        """Abort both sides and stop the task forwarding for this link."""
        self.close()
        if self.task is not None:
            self.task.cancel()


class Proxy:
    """The proxy itself; every method must run on the loop that called ``start()``."""

    def __init__(self, upstream_port: int, upstream_host: str = HOST) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self.mode = Mode.PASS
        #: Connections accepted so far (in any mode).
        self.accepted = 0
        self._passing = asyncio.Event()
        self._passing.set()
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    @property
    def open_connections(self) -> int:
        return len(self._links)

    async def start(self, port: int = 0) -> int:
        """Listen on 127.0.0.1 (``port`` 0: a free one); return the port."""
        self._server = await asyncio.start_server(self._accept, HOST, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop listening and abort every connection."""
        if self._server is not None:
            self._server.close()
        tasks = [link.task for link in self._links if link.task is not None]
        for link in list(self._links):
            link.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=5)  # let each link unwind before the loop ends
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def set_mode(self, mode: Mode) -> None:
        self.mode = mode
        if mode is Mode.PASS:
            self._passing.set()
            return
        self._passing.clear()
        if mode is Mode.CUT:
            for link in list(self._links):
                link.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode is Mode.CUT:
            writer.transport.abort()
            return
        link = _Link(writer)
        link.task = asyncio.current_task()
        self._links.add(link)
        try:
            await self._passing.wait()  # a connection made during a hang stays silent
            up_reader, link.upstream = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
            pumps = [
                asyncio.create_task(self._pump(reader, link.upstream)),
                asyncio.create_task(self._pump(up_reader, writer)),
            ]
            try:
                # Either side closing ends the link: a half-open proxy would hide it.
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while True:
            await self._passing.wait()
            data = await source.read(CHUNK)
            if not data:
                return
            await self._passing.wait()  # read before a hang began: hold it, never drop it
            sink.write(data)
            await sink.drain()


class ProxyThread:
    """A ``Proxy`` on its own event loop in a daemon thread; methods are thread-safe."""

    def __init__(self, upstream_port: int, upstream_host: str = HOST) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"proxy->{upstream_port}", daemon=True
        )
        self._proxy: Proxy | None = None
        self._upstream = (upstream_host, upstream_port)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, port: int = 0) -> int:
        self._thread.start()

        async def make() -> Proxy:
            proxy = Proxy(self._upstream[1], self._upstream[0])
            await proxy.start(port)
            return proxy

        self._proxy = self._call(make())
        return self._proxy.port

    @property
    def proxy(self) -> Proxy:
        assert self._proxy is not None, "ProxyThread.start() was not called"
        return self._proxy

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def mode(self) -> Mode:
        return self.proxy.mode

    @property
    def open_connections(self) -> int:
        return self.proxy.open_connections

    def set_mode(self, mode: Mode) -> None:
        async def switch() -> None:
            self.proxy.set_mode(mode)

        self._call(switch())

    def pass_(self) -> None:
        self.set_mode(Mode.PASS)

    def hang(self) -> None:
        self.set_mode(Mode.HANG)

    def cut(self) -> None:
        self.set_mode(Mode.CUT)

    def close(self) -> None:
        """Stop the proxy and its thread (safe to call twice)."""
        if not self._thread.is_alive():
            return
        if self._proxy is not None:
            with contextlib.suppress(Exception):
                self._call(self._proxy.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
