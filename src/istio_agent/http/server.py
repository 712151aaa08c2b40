"""An HTTP/1.1 server on h11 over asyncio streams, shaped like aiohttp's runner and sites.

``ServerRunner`` owns the handler and the live connections and shuts them down gracefully: the
sites stop listening, idle keep-alive connections close at once, requests in flight get a bounded
time to finish (answered with ``Connection: close``), and whatever is left is cancelled. A site
(``TCPSite`` for host:port, ``SockSite`` for a socket already listening) accepts connections for
its runner. Built on streams only, so it runs the same on asyncio's loop and on uvloop.

Per connection: keep-alive (idle connections close after ``Limits.keepalive_timeout``), pipelined
requests answered in order, HEAD (headers as for GET, no body), ``Expect: 100-continue`` (the 100
is sent when the handler reads the body; a handler that answers without reading closes the
connection instead of waiting for a body it never asked for), request head and body size limits
(431, 413). A handler that raises is logged with its traceback once and answered 500.

Hostile or broken clients cost little and never flood the log, whoever can reach the port: a
malformed request gets its 400 (431, 505) and a closed connection; a request head must be complete
within ``Limits.header_timeout`` (Go's ReadHeaderTimeout: a client that connects and sends nothing,
or trickles its head, is closed); at most ``Limits.max_connections`` are held at once. A new
connection beyond that takes the place of one that is not in a request (idle between requests, or
still sending its head): the one idle the longest, of the peer address that holds the most. A
flood of half-open connections from one neighbour therefore evicts its own connections, never a
kubelet's probe (Istio's Go server has no cap at all; ours keeps its file descriptors bounded and
still serves the probes). Only when every connection is in a request is a new one closed at once.
Each such connection is reported to the runner's ``on_reject`` (metrics) and logged on a debug line
at most every ``REJECT_LOG_INTERVAL`` seconds.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

import h11

from istio_agent.http.headers import Headers
from istio_agent.http.messages import Handler, Request, RequestBodyTooLarge, Response, StreamResponse
from istio_agent.log import scope

log = scope("http")

READ_SIZE = 65536
SHUTDOWN_TIMEOUT = 2.0
REJECT_LOG_INTERVAL = 10.0
"""At most one debug line per this many seconds about rejected connections (the rest are counted)."""
_REJECT_DETAIL_MAX = 120
"""h11's error text quotes the offending bytes: a log line shows only this many characters of it."""

MALFORMED = "malformed_request"
HEADER_TIMEOUT = "header_timeout"
CONNECTION_LIMIT = "connection_limit"
"""Why a connection was closed without serving a request (``on_reject``'s argument)."""

RejectObserver = Callable[[str], None]


class ByteReader(Protocol):
    """What a connection reads from: an ``asyncio.StreamReader``, or one with sniffed bytes put back."""

    async def read(self, n: int = -1) -> bytes: ...


class ClientDisconnected(ConnectionResetError):
    """The client went away while the response was being written."""


@dataclass(frozen=True)
class Limits:
    """Per-connection limits of a server."""

    max_head: int = 64 * 1024
    """Request line and headers; beyond it the answer is 431."""
    max_body: int = 2**20
    """Request body a handler may read (413 beyond); also the most discarded after a response."""
    keepalive_timeout: float = 75.0
    """Seconds an idle kept-alive connection waits for the first byte of its next request (aiohttp's default)."""
    header_timeout: float = 10.0
    """Seconds to receive a whole request head: from the connection for the first request, from its
    first byte for the next ones (Go's ReadHeaderTimeout). Every client of the agent sends its head
    at once; a slowloris client is closed."""
    max_connections: int = 512
    """Connections held at once (each holds a file descriptor); a new one beyond evicts an idle one."""


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


_date_cache: tuple[int, str] = (0, "")
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def format_http_date(seconds: float) -> str:
    """RFC 9110's IMF-fixdate (``Sun, 06 Nov 1994 08:49:37 GMT``), in English whatever the locale.

    Written here rather than taken from ``email.utils``, which would load the email package (~1 MB
    resident) into every agent for this one line.
    """
    t = time.gmtime(seconds)
    return (
        f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
        f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"
    )


def http_date() -> str:
    """The Date header value, computed at most once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, format_http_date(now))
    return _date_cache[1]


def _head_size(head: h11.Request) -> int:
    return len(head.target) + sum(len(name) + len(value) + 4 for name, value in head.headers.raw_items())


def _has_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


class _Connection:
    """One client connection: reads requests with h11, runs the handler, writes its responses."""

    def __init__(self, runner: ServerRunner, reader: ByteReader, writer: asyncio.StreamWriter) -> None:
        self._runner = runner
        self._limits = runner.limits
        self._reader = reader
        self._writer = writer
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self._limits.max_head)
        name = writer.get_extra_info("peername")
        self.peer = (str(name[0]), int(name[1])) if isinstance(name, tuple) and len(name) >= 2 else None
        self.host = self.peer[0] if self.peer else ""
        """The peer's address without the port: connections are weighed per host when evicting."""
        self.idle = True
        self.idle_since = asyncio.get_running_loop().time()
        self.closing = False
        self.evicted = False
        self._method = ""
        self._status = 0
        self._started = False
        self._ended = False
        self._body_done = False
        self._broken = False

    def begin_close(self) -> None:
        """Shutdown: an idle connection closes now; a busy one after its response (Connection: close)."""
        self.closing = True
        if self.idle:
            self._writer.close()

    def evict(self) -> None:
        """Make room for a new connection: drop this idle one at once (its descriptor is freed now)."""
        self.closing = self.evicted = True
        self._writer.transport.abort()

    async def serve(self) -> None:
        try:
            await self._serve()
        except h11.RemoteProtocolError as err:
            if self.evicted:  # its head was cut short by the eviction, not by the client
                return
            self._runner.rejected(MALFORMED, self.peer, str(err))
            await self._reject(err)
        except ClientDisconnected:
            log.debug("client %s disconnected during the response", self.peer)
        finally:
            self._writer.close()

    async def _serve(self) -> None:
        first = True
        while not self.closing:
            self.idle = True
            self.idle_since = asyncio.get_running_loop().time()
            event = await self._next_head(first)
            first = False
            if not isinstance(event, h11.Request):  # ConnectionClosed, or timed out
                return
            if event.http_version not in (b"1.0", b"1.1"):
                raise h11.RemoteProtocolError("unsupported HTTP version", error_status_hint=505)
            if _head_size(event) > self._limits.max_head:  # h11 only bounds a head still incomplete
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            self.idle = False
            await self._respond(event)
            if not await self._finish_cycle():
                return

    async def _next_head(self, first: bool) -> h11.Event | type[h11.PAUSED] | None:
        """The next request head (or ConnectionClosed); None when the client took too long.

        A new connection has ``header_timeout`` for its whole first head. A kept-alive one may stay
        silent for ``keepalive_timeout`` (closed quietly then), and once its next head has begun
        (a first byte, or pipelined bytes already here) that head has ``header_timeout`` too.
        """
        limits = self._limits
        loop = asyncio.get_running_loop()
        begun = first or bool(self._h11.trailing_data[0])
        try:
            async with asyncio.timeout(
                limits.header_timeout if begun else limits.keepalive_timeout
            ) as deadline:
                while True:
                    event = self._h11.next_event()
                    if event is not h11.NEED_DATA:
                        return event  # type: ignore[return-value]
                    data = await self._read()
                    if data and not begun:
                        begun = True
                        deadline.reschedule(loop.time() + limits.header_timeout)
                    self._h11.receive_data(data)
        except TimeoutError:
            if begun and not self.evicted:
                self._runner.rejected(
                    HEADER_TIMEOUT, self.peer, f"no complete request head within {limits.header_timeout:g}s"
                )
            return None

    async def _next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            self._h11.receive_data(await self._read())

    async def _read(self) -> bytes:
        """Bytes from the client; b"" (end of stream) when the connection failed (reset, timed out)."""
        try:
            return await self._reader.read(READ_SIZE)
        except OSError:
            return b""

    async def _respond(self, head: h11.Request) -> None:
        self._method = head.method.decode("ascii", "replace")
        self._status = 0
        self._started = self._ended = self._body_done = False
        request = Request(
            self._method,
            head.target.decode("latin-1"),
            Headers.from_raw(head.headers.raw_items()),
            http_version=head.http_version.decode("ascii", "replace"),
            peer=self.peer,
            channel=self,
            max_body=self._limits.max_body,
        )
        try:
            response = await self._runner.handler(request)
            if not isinstance(response, StreamResponse):
                raise TypeError(f"the handler returned {type(response).__name__}, not a response")
            if not response.prepared:
                await response.prepare(request)
            if not self._ended:
                await self.end_response()
        except (ClientDisconnected, h11.RemoteProtocolError):
            raise
        except RequestBodyTooLarge as err:
            await self._fail(413, str(err))
        except Exception:
            log.exception("HTTP handler failed on %s %s", self._method, request.path)
            await self._fail(500, "Internal Server Error")

    async def _fail(self, status: int, text: str) -> None:
        """Answer ``status`` and close, or (the response already begun) just drop the connection."""
        self.closing = True
        if self._started or self._h11.our_state is not h11.SEND_RESPONSE:
            self._broken = True
            return
        response = Response(status, text=text + "\n")
        await self.start_response(response, response.body)

    async def _finish_cycle(self) -> bool:
        """Ready the connection for the next request; False when it must close instead."""
        if self._broken or self.closing or self._h11.our_state is not h11.DONE:
            return False
        if self._h11.their_state is h11.SEND_BODY:  # a body the handler did not read: skip it (bounded)
            skipped = 0
            try:
                async with asyncio.timeout(self._limits.keepalive_timeout):
                    while chunk := await self.receive_body():
                        skipped += len(chunk)
                        if skipped > self._limits.max_body:
                            return False
            except TimeoutError:
                return False
        if self._h11.their_state is not h11.DONE:
            return False
        self._h11.start_next_cycle()
        return True

    # -- Channel: what Request and the responses call ------------------------------------------------
    async def receive_body(self) -> bytes:
        while not self._body_done:
            if self._h11.they_are_waiting_for_100_continue:
                await self._write([self._h11.send(h11.InformationalResponse(status_code=100, headers=[]))])
            event = await self._next_event()
            if isinstance(event, h11.Data):
                if event.data:
                    return bytes(event.data)
            else:  # EndOfMessage (h11 raises for a body cut short)
                self._body_done = True
        return b""

    async def start_response(self, response: StreamResponse, body: bytes | None) -> None:
        if self._started:
            raise RuntimeError("a response was already sent for this request")
        status = response.status
        headers = response.headers
        if body is not None and _has_body("GET", status):
            headers["Content-Length"] = str(len(body))  # also for HEAD: what GET would answer
        if self.closing or self._h11.they_are_waiting_for_100_continue:
            headers["Connection"] = "close"
        headers.setdefault("Date", http_date())
        reason = response.reason if response.reason is not None else reason_phrase(status)
        head = h11.Response(status_code=status, headers=headers.raw(), reason=reason.encode("latin-1"))
        parts: list[bytes] = [self._h11.send(head)]
        self._started = True
        self._status = status
        if body is not None:
            if body and _has_body(self._method, status):
                parts.extend(self._h11.send_with_data_passthrough(h11.Data(data=body)) or [])
            parts.append(self._h11.send(h11.EndOfMessage()))
            self._ended = True
        await self._write(parts)

    async def send_body(self, data: bytes | bytearray | memoryview) -> None:
        if not self._started or self._ended:
            raise RuntimeError("send_body() outside a started response")
        if _has_body(self._method, self._status):
            event = h11.Data(data=data)  # type: ignore[arg-type]  # h11 takes any bytes-like object
            await self._write(self._h11.send_with_data_passthrough(event) or [])

    async def end_response(self) -> None:
        if not self._started or self._ended:
            raise RuntimeError("end_response() outside a started response")
        self._ended = True
        await self._write([self._h11.send(h11.EndOfMessage())])

    async def _write(self, parts: list[bytes]) -> None:
        if self._writer.is_closing():
            raise ClientDisconnected("the client disconnected")
        # One write of one joined copy: the transport keeps no reference to the caller's buffers.
        self._writer.write(b"".join(parts))
        try:
            await self._writer.drain()
        except ConnectionError as err:
            raise ClientDisconnected(str(err) or "the client disconnected") from None

    async def _reject(self, err: h11.RemoteProtocolError) -> None:
        """A malformed request: answer its status (400, 431, ...) and close; never a traceback."""
        if self._writer.is_closing() or self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = err.error_status_hint
        body = f"{status} {reason_phrase(status)}\n".encode()
        head = h11.Response(
            status_code=status,
            headers=[
                (b"Content-Type", b"text/plain; charset=utf-8"),
                (b"Content-Length", str(len(body)).encode()),
                (b"Connection", b"close"),
                (b"Date", http_date().encode()),
            ],
            reason=reason_phrase(status).encode(),
        )
        try:
            parts = [
                self._h11.send(head),
                self._h11.send(h11.Data(data=body)),
                self._h11.send(h11.EndOfMessage()),
            ]
            await self._write(parts)
        except (h11.LocalProtocolError, ClientDisconnected):
            pass


class ServerRunner:
    """The handler, the connections and a graceful shutdown; sites feed it connections."""

    def __init__(
        self,
        handler: Handler,
        *,
        limits: Limits | None = None,
        shutdown_timeout: float = SHUTDOWN_TIMEOUT,
        on_reject: RejectObserver | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        self.shutdown_timeout = shutdown_timeout
        self._on_reject = on_reject
        self._connections: dict[_Connection, asyncio.Task[object]] = {}
        self._adopted: set[asyncio.Task[None]] = set()
        self._sites: list[BaseSite] = []
        self._closed = False
        self._next_reject_log = 0.0
        self._unlogged_rejects = 0

    @property
    def sites(self) -> list[BaseSite]:
        return list(self._sites)

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def accept(self, reader: ByteReader, writer: asyncio.StreamWriter) -> None:
        """Serve one accepted connection until it closes (a stream server's client callback)."""
        task = asyncio.current_task()
        if self._closed or task is None:
            writer.close()
            return
        if len(self._connections) >= self.limits.max_connections:
            victim = self._eviction_candidate()
            if victim is None:
                writer.close()
                self.rejected(CONNECTION_LIMIT, writer.get_extra_info("peername"), "too many connections")
                return
            del self._connections[victim]
            victim.evict()
            self.rejected(
                CONNECTION_LIMIT, victim.peer, "closed an idle connection to make room for a new one"
            )
        connection = _Connection(self, reader, writer)
        self._connections[connection] = task
        try:
            await connection.serve()
        finally:
            self._connections.pop(connection, None)

    def adopt(self, transport: asyncio.Transport, first: bytes = b"") -> asyncio.Protocol:
        """Serve a connection accepted elsewhere, whose first bytes (``first``) were already read.

        One port can serve HTTP/1.1 and another protocol this way (the debug tap sniffs HTTP/2's
        preface). The connection gets a stream reader as an accepted one would, so it is read only
        as fast as it is answered. Returns the protocol now set on ``transport``.
        """
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if first:
            protocol.data_received(first)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        task = asyncio.ensure_future(self.accept(reader, writer))
        self._adopted.add(task)  # held until it runs: accept() then tracks it as a connection
        task.add_done_callback(self._adopted.discard)
        return protocol

    def _eviction_candidate(self) -> _Connection | None:
        """The connection to drop for a new one: not in a request, of the peer holding the most
        connections, idle the longest. None when every connection is in a request."""
        held = Counter(connection.host for connection in self._connections)
        idle = (connection for connection in self._connections if connection.idle)
        return min(idle, key=lambda c: (-held[c.host], c.idle_since), default=None)

    def rejected(self, reason: str, peer: object, detail: str) -> None:
        """A connection closed without a request served: report it; log it unless a line went out lately."""
        if self._on_reject is not None:
            self._on_reject(reason)
        now = time.monotonic()
        if now < self._next_reject_log:
            self._unlogged_rejects += 1
            return
        self._next_reject_log = now + REJECT_LOG_INTERVAL
        more, self._unlogged_rejects = self._unlogged_rejects, 0
        log.debug(
            "closed a connection from %s (%s): %s%s",
            peer,
            reason,
            detail[:_REJECT_DETAIL_MAX],
            f" ({more} more since the last such line)" if more else "",
        )

    async def cleanup(self, timeout: float | None = None) -> None:
        """Stop every site, finish the requests in flight within ``timeout``, cancel the rest."""
        for site in list(self._sites):
            await site.stop()
        self._closed = True
        for connection in list(self._connections):
            connection.begin_close()
        tasks = list(self._connections.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.shutdown_timeout if timeout is None else timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


class BaseSite:
    """A listener feeding one runner."""

    def __init__(self, runner: ServerRunner) -> None:
        self._runner = runner
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("site already started")
        self._server = await self._listen()
        self._runner._sites.append(self)

    async def _listen(self) -> asyncio.Server:
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop accepting: from now on connecting is refused. Connections in progress go on."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            self._runner._sites.remove(self)

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._server.sockets) if self._server is not None else []

    @property
    def port(self) -> int:
        """The bound port (0 before start())."""
        sockets = self.sockets
        return int(sockets[0].getsockname()[1]) if sockets else 0


class TCPSite(BaseSite):
    """Listens on ``host:port`` (port 0 picks one; see ``port``)."""

    def __init__(self, runner: ServerRunner, host: str, port: int, *, backlog: int = 128) -> None:
        super().__init__(runner)
        self._host = host.strip("[]")
        self._port = port
        self._backlog = backlog

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(
            self._runner.accept, self._host, self._port, backlog=self._backlog, reuse_address=True
        )


class SockSite(BaseSite):
    """Serves on a socket that is already bound (and listening)."""

    def __init__(self, runner: ServerRunner, sock: socket.socket) -> None:
        super().__init__(runner)
        self._sock = sock

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._runner.accept, sock=self._sock)
