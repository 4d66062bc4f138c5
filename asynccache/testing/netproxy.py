"""``TcpProxy``: a real TCP proxy on 127.0.0.1 that passes, delays or black-holes traffic.

Put it between a client and a server (an S3 endpoint: the ``asynccache_s3_proxy`` fixture does
that for the plugin's SeaweedFS) to see what a slow or dead store does to your engine, with the
real client library, its connection pool and its timeouts in play:

* :meth:`~TcpProxy.pass_through`: bytes go through as they come (the default);
* :meth:`~TcpProxy.delay`: every chunk, either way, waits ``seconds`` first (a slow link or a
  slow server);
* :meth:`~TcpProxy.black_hole`: connections are accepted and whatever arrives, either way, is
  swallowed: no answer, no reset, no error, only silence (a hung server, a network partition).
  Connections that lost bytes are closed when traffic passes again, so clients reconnect;
* :meth:`~TcpProxy.reset`: every open connection is closed with a reset (``ECONNRESET``).

The mode applies to connections already open, not only to new ones: a connection pool cannot
dodge it. The proxy runs its own event loop on a daemon thread, so it keeps serving while the
test's loop is blocked or busy, and a test that forgets to stop it cannot hang the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from asynccache.testing.s3 import S3Server

__all__ = ["ProxyStats", "TcpProxy"]

_CHUNK = 64 * 1024


@dataclass
class ProxyStats:
    """What went through (bytes, per direction) and what was swallowed."""

    connections: int = 0
    bytes_up: int = 0  # client -> server
    bytes_down: int = 0  # server -> client
    swallowed: int = 0  # bytes dropped while black-holed
    resets: int = 0


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    lost: bool = False  # bytes were swallowed: the stream is broken
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class TcpProxy:
    """A TCP proxy from ``127.0.0.1:<port>`` to ``target`` (``host:port`` or an ``http(s)://``
    URL); see the module docstring. Use it as a context manager, or :meth:`start` /
    :meth:`stop`."""

    def __init__(self, target: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        parts = urlsplit(target if "://" in target else f"tcp://{target}")
        if not parts.hostname or not parts.port:
            raise ValueError(f"TcpProxy target must be host:port or a URL with a port: {target!r}")
        self.target_host = parts.hostname
        self.target_port = parts.port
        self._scheme = parts.scheme if parts.scheme in ("http", "https") else None
        self.host = host
        self.port = port
        self.mode = "pass"
        self.delay_s = 0.0
        self.stats = ProxyStats()
        #: The S3 server as seen through this proxy (set by the ``asynccache_s3_proxy`` fixture).
        self.s3: S3Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()

    # -- the endpoint -----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>`` (the target's scheme), or ``host:port`` for a bare
        target."""
        return f"{self._scheme}://{self.address}" if self._scheme else self.address

    # -- modes ------------------------------------------------------------------------------------

    def pass_through(self) -> None:
        """Pass bytes as they come; connections that lost bytes while black-holed are reset."""
        self.mode, self.delay_s = "pass", 0.0
        self._call(self._drop_broken)

    def delay(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` before passing it on (both ways)."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0, got {seconds!r}")
        self.mode, self.delay_s = "delay", float(seconds)
        self._call(self._drop_broken)

    def black_hole(self) -> None:
        """Swallow everything, both ways, on every connection: silence."""
        self.mode = "black_hole"

    def reset(self) -> None:
        """Close every open connection with a reset now."""
        self._call(self._reset_all)

    # -- life -------------------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, self.host, self.port)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="asynccache-tcp-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        thread, self._thread = self._thread, None
        loop = self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"TcpProxy({self.address} -> {self.target_host}:{self.target_port}, mode={self.mode}"
            f"{f', delay {self.delay_s} s' if self.mode == 'delay' else ''})"
        )

    # -- the loop thread --------------------------------------------------------------------------

    def _call(self, fn: object) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn)  # type: ignore[arg-type]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        self._conns.add(conn)
        self.stats.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            _abort(writer)
            self._conns.discard(conn)
            return
        conn.server = up_writer
        up = asyncio.ensure_future(self._pump(conn, reader, up_writer, "up"))
        down = asyncio.ensure_future(self._pump(conn, up_reader, writer, "down"))
        conn.tasks = [up, down]
        try:
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            _abort(writer)
            _abort(up_writer)

    async def _pump(
        self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: str
    ) -> None:
        try:
            while data := await src.read(_CHUNK):
                if self.mode == "black_hole":
                    self.stats.swallowed += len(data)
                    conn.lost = True
                    continue
                if self.mode == "delay" and self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                    if self.mode == "black_hole":  # black-holed while it waited
                        self.stats.swallowed += len(data)
                        conn.lost = True
                        continue
                if way == "up":  # counted before the peer can see them
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # One side is done: the whole connection is, once the other side drains.
            if way == "down" or self.mode == "black_hole":
                for t in conn.tasks:
                    if t is not asyncio.current_task():
                        t.cancel()

    def _drop_broken(self) -> None:
        for conn in list(self._conns):
            if conn.lost:
                self._reset(conn)

    def _reset_all(self) -> None:
        for conn in list(self._conns):
            self._reset(conn)

    def _reset(self, conn: _Conn) -> None:
        self.stats.resets += 1
        for w in (conn.client, conn.server):
            if w is not None:
                _abort(w, rst=True)
        for t in conn.tasks:
            t.cancel()
        self._conns.discard(conn)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            self._reset(conn)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _abort(writer: asyncio.StreamWriter, *, rst: bool = False) -> None:
    """Close a connection; with ``rst``, with a TCP reset (SO_LINGER 0)."""
    if rst:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        if rst:
            writer.transport.abort()
        else:
            writer.close()
