"""The status port while the agent starts, before the full status server is loaded.

The full server (metrics merging, app probes, quit/drain) is built on aiohttp, which takes about
100 ms of the event loop to import. Importing it while Envoy starts would stall the SDS and xDS
answers Envoy is waiting for, so the agent binds the status port at once and this small server
answers ``/healthz/ready`` itself. Any other request asks for the full server to be loaded now,
and its connection is handed to the full server as is (same transport, so the same peer address
for the loopback-only checks) once that is up. Nobody sees a 503 that Istio would not give.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any, cast

from istio_agent.log import scope
from istio_agent.status.readiness import Readiness

log = scope("status")

MAX_REQUEST_HEAD = 8192
HANDOVER_TIMEOUT = 10.0
ProtocolFactory = Callable[[], asyncio.Protocol]


def bind_status_socket(host: str, port: int) -> socket.socket:
    """The status port's listening socket, shared by the early and the full server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"status server cannot listen on {host}:{port}: {err.strerror}") from None
    sock.setblocking(False)
    return sock


def _response(status: int, reason: str, body: str, head_only: bool) -> bytes:
    payload = body.encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else payload)


class EarlyStatusServer:
    """Answers ``/healthz/ready`` on a duplicate of the status socket; hands other requests over."""

    def __init__(self, sock: socket.socket, readiness: Readiness) -> None:
        self._sock = sock.dup()  # closing this server must leave the full server's socket open
        self._readiness = readiness
        self._server: asyncio.Server | None = None
        self.full_server_wanted = asyncio.Event()
        """Set when a request needs the full server: the agent should load it now."""
        self._full: asyncio.Future[ProtocolFactory] = asyncio.get_running_loop().create_future()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _EarlyConnection(self), sock=self._sock)

    def hand_over(self, factory: ProtocolFactory) -> None:
        """The full server is up: waiting connections go to ``factory``'s protocols (aiohttp's web.Server)."""
        if not self._full.done():
            self._full.set_result(factory)

    async def close(self) -> None:
        """Stop accepting (the full server accepts from now on).

        After ``hand_over`` the requests in progress finish; otherwise (the agent is stopping) their
        connections are closed.
        """
        if self._server is not None:
            self._server.close()
            self._server = None
        if not self._full.done():
            self._full.cancel()
            for task in list(self._tasks):
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def answer_ready(self, transport: asyncio.Transport, head_only: bool) -> None:
        try:
            error = await self._readiness.check()
            if error is None:
                transport.write(_response(200, "OK", "", head_only))
            else:
                transport.write(_response(503, "Service Unavailable", error + "\n", head_only))
        finally:
            transport.close()

    async def hand_over_later(self, transport: asyncio.Transport, received: bytes) -> None:
        """Wait for the full server, then make it the connection's protocol, replaying what was read."""
        self.full_server_wanted.set()
        try:
            factory = await asyncio.wait_for(asyncio.shield(self._full), HANDOVER_TIMEOUT)
        except TimeoutError:
            log.warning(
                "the status server did not load within %gs; dropping a waiting request", HANDOVER_TIMEOUT
            )
            transport.close()
            return
        except asyncio.CancelledError:
            transport.close()
            raise
        if transport.is_closing():
            return
        protocol = factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(received)
        transport.resume_reading()


class _EarlyConnection(asyncio.Protocol):
    """Reads a request head; readiness is answered here, anything else waits for the full server."""

    def __init__(self, server: EarlyStatusServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._decided = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: no isinstance check
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._decided or self._transport is None:
            return
        self._buffer += data
        if self._buffer.find(b"\r\n\r\n") < 0:  # the whole head, so that closing after the answer is clean
            if len(self._buffer) > MAX_REQUEST_HEAD:
                self._transport.close()
            return
        self._decided = True
        request_line = bytes(self._buffer[: self._buffer.find(b"\r\n")])
        method, _, rest = request_line.decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        transport = self._transport
        transport.pause_reading()
        if path == "/healthz/ready" and method in ("GET", "HEAD"):
            self._server.spawn(self._server.answer_ready(transport, method == "HEAD"))
        else:
            self._server.spawn(self._server.hand_over_later(transport, bytes(self._buffer)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
