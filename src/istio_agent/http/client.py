"""An HTTP/1.1 client on h11: one request per connection, or a small keep-alive pool.

Used for Envoy's admin API, the merged metrics' upstreams, app and VM health probes and
``pilot-agent wait``/``request``. What they need and get here:

- a response whose body is read as it arrives (``read_chunk``) or whole and capped (``read``);
- dialing through ``dial`` (a socket factory for the probes' source address, TLS with ALPN), or
  through any ``Connector`` a test supplies (the transport seam);
- clear errors: ``ConnectError`` (carrying the ``OSError``), ``ProtocolError``, ``BodyTooLarge``,
  all ``HTTPError``; a timeout is the caller's ``asyncio.timeout`` (``fetch`` takes one).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import TracebackType

import h11

from istio_agent.http.dial import SocketFactory, Stream, open_stream
from istio_agent.http.exchange import (
    DEFAULT_MAX_BODY,
    IDEMPOTENT,
    MAX_HEAD,
    URL,
    BodyTooLarge,
    ClientExchange,
    ConnectError,
    Fetched,
    HTTPError,
    ProtocolError,
    default_tls,
    describe,
    request_fields,
)
from istio_agent.http.headers import Fields, Headers

__all__ = [
    "DEFAULT_MAX_BODY",
    "MAX_HEAD",
    "URL",
    "BodyTooLarge",
    "Client",
    "ClientResponse",
    "ConnectError",
    "Connection",
    "Fetched",
    "HTTPError",
    "ProtocolError",
    "fetch",
]

READ_SIZE = 256 * 1024  # what an asyncio transport reads at once: one h11 event per socket read
IDLE_TIMEOUT = 60.0
"""A pooled connection idle longer than this is not reused (servers close theirs at about this age)."""
MAX_IDLE_PER_ORIGIN = 2
Connector = Callable[[URL], Awaitable[Stream]]
"""Opens the stream a request to ``URL`` goes over (the default dials; tests may supply their own)."""


class Connection:
    """HTTP/1.1 over one stream: requests one after another, kept alive when both sides allow."""

    def __init__(
        self,
        stream: Stream,
        *,
        origin: tuple[str, str, int] = ("", "", 0),
        max_head: int = MAX_HEAD,
        on_idle: Callable[[Connection], Awaitable[None]] | None = None,
    ) -> None:
        self.stream = stream
        self.origin = origin
        self._exchange = ClientExchange(max_head)
        self._h11 = self._exchange.h11
        self._on_idle = on_idle
        self.idle_since = time.monotonic()

    @property
    def usable(self) -> bool:
        """Idle and still open (the server may have closed a kept-alive connection meanwhile)."""
        return self._h11.our_state is h11.IDLE and not self.stream.closing

    async def request(self, method: str, target: str, headers: Headers, body: bytes = b"") -> ClientResponse:
        """Send the request and read the response head; the body is the response's to read."""
        parts = self._exchange.request(method, target, headers, body)
        try:
            self.stream.writer.writelines(parts)
            await self.stream.writer.drain()
        except OSError as err:
            raise ProtocolError(f"connection lost while sending the request: {describe(err)}") from None
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response):
                break
            # InformationalResponse (100 Continue, 103 Early Hints): the final answer follows
        try:
            self._exchange.check_head(event)
        except ProtocolError:
            self.abort()
            raise
        return ClientResponse(
            self,
            status=event.status_code,
            reason=event.reason.decode("latin-1"),
            headers=Headers.from_raw(event.headers.raw_items()),
            method=method,
        )

    async def next_event(self) -> h11.Event:
        while True:
            event = self._exchange.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            try:
                data = await self.stream.reader.read(READ_SIZE)
            except OSError as err:
                raise ProtocolError(f"connection lost: {describe(err)}") from None
            self._exchange.receive(data)

    async def finished(self) -> None:
        """The response is complete: reuse the connection when both sides keep it alive, else close."""
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self.idle_since = time.monotonic()
            if self._on_idle is not None:
                await self._on_idle(self)
                return
        await self.close()

    async def close(self) -> None:
        await self.stream.close()

    def abort(self) -> None:
        self.stream.abort()


class ClientResponse:
    """A response whose body is read on demand; close it (``async with``) when done."""

    def __init__(
        self, connection: Connection, *, status: int, reason: str, headers: Headers, method: str
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.method = method
        self.truncated = False
        """Set by ``read(truncate=True)`` when it cut the body."""
        self._connection: Connection | None = connection

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.strip().isdigit() else None

    async def read_chunk(self) -> bytes | bytearray:
        """The next piece of the body as it arrives (the caller's to keep or change); ``b""`` at its end."""
        while self._connection is not None:
            connection = self._connection
            try:
                event = await connection.next_event()
            except BaseException:
                self._abandon()
                raise
            if isinstance(event, h11.Data):
                if event.data:
                    return event.data  # h11's own bytearray: no copy
                continue
            self._connection = None  # EndOfMessage
            await connection.finished()
        return b""

    async def read(self, max_body: int | None = DEFAULT_MAX_BODY, *, truncate: bool = False) -> bytes:
        """The whole body. Past ``max_body`` bytes: BodyTooLarge, or with ``truncate`` the first ``max_body``."""
        return bytes(await self.read_buffer(max_body, truncate=truncate))

    async def read_buffer(
        self, max_body: int | None = DEFAULT_MAX_BODY, *, truncate: bool = False
    ) -> bytearray:
        """:meth:`read`, in the buffer the body was gathered in: no copy into ``bytes``, so a big body
        (a Wasm module) is held once in memory, not twice while it is copied."""
        length = self.content_length
        if max_body is not None and not truncate and length is not None and length > max_body:
            await self.aclose()
            raise BodyTooLarge(f"response body of {length} bytes exceeds the {max_body} byte cap")
        body = bytearray()
        while chunk := await self.read_chunk():
            body += chunk
            if max_body is not None and len(body) > max_body:
                await self.aclose()
                if not truncate:
                    raise BodyTooLarge(f"response body exceeds the {max_body} byte cap")
                del body[max_body:]
                self.truncated = True
                break
        return body

    @property
    def complete(self) -> bool:
        return self._connection is None

    async def aclose(self) -> None:
        """Done with the response: a body not read to its end costs the connection."""
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.abort()

    def _abandon(self) -> None:
        if self._connection is not None:
            self._connection.abort()
            self._connection = None

    async def __aenter__(self) -> ClientResponse:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Client:
    """Requests to http(s) URLs; with ``keepalive`` connections are pooled per origin."""

    def __init__(
        self,
        *,
        tls: ssl.SSLContext | None = None,
        socket_factory: SocketFactory | None = None,
        keepalive: bool = False,
        connector: Connector | None = None,
        max_head: int = MAX_HEAD,
    ) -> None:
        self._tls = tls
        self._socket_factory = socket_factory
        self._keepalive = keepalive
        self._connector = connector or self._dial
        self._max_head = max_head
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}

    async def _dial(self, url: URL) -> Stream:
        tls = None
        if url.scheme == "https":
            tls = self._tls if self._tls is not None else default_tls()
        try:
            return await open_stream(url.host, url.port, tls=tls, socket_factory=self._socket_factory)
        except OSError as err:  # refused, unreachable, no such host, TLS handshake
            raise ConnectError(url.address, err) from None

    async def request(
        self,
        method: str,
        url: str | URL,
        *,
        headers: Headers | Fields | None = None,
        body: bytes = b"",
    ) -> ClientResponse:
        """Send ``method url`` and return the response once its head is in; the caller closes it."""
        target = url if isinstance(url, URL) else URL.parse(url)
        fields = self._fields(method, target, headers, body)
        connection, reused = await self._acquire(target)
        try:
            return await connection.request(method, target.target, fields, body)
        except ProtocolError:
            connection.abort()
            if not (reused and method in IDEMPOTENT):
                raise
        except BaseException:
            connection.abort()
            raise
        # A kept-alive connection the server had closed meanwhile: once more on a new one.
        connection = await self._connect(target)
        try:
            return await connection.request(method, target.target, fields, body)
        except BaseException:
            connection.abort()
            raise

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str | URL,
        *,
        headers: Headers | Fields | None = None,
        body: bytes = b"",
    ) -> AsyncIterator[ClientResponse]:
        """``request()`` as a context manager that closes the response."""
        response = await self.request(method, url, headers=headers, body=body)
        try:
            yield response
        finally:
            await response.aclose()

    async def fetch(
        self,
        method: str,
        url: str | URL,
        *,
        headers: Headers | Fields | None = None,
        body: bytes = b"",
        max_body: int | None = DEFAULT_MAX_BODY,
        truncate: bool = False,
    ) -> Fetched:
        """The whole response (body capped at ``max_body``: see ``ClientResponse.read``)."""
        async with self.stream(method, url, headers=headers, body=body) as response:
            content = await response.read(max_body, truncate=truncate)
        return Fetched(response.status, response.reason, response.headers, content, response.truncated)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await connection.close()

    def _fields(self, method: str, url: URL, headers: Headers | Fields | None, body: bytes) -> Headers:
        return request_fields(method, url, headers, body, keepalive=self._keepalive)

    async def _acquire(self, url: URL) -> tuple[Connection, bool]:
        pool = self._idle.get((url.scheme, url.host, url.port), [])
        while pool:
            connection = pool.pop()
            if connection.usable and time.monotonic() - connection.idle_since < IDLE_TIMEOUT:
                return connection, True
            connection.abort()
        return await self._connect(url), False

    async def _connect(self, url: URL) -> Connection:
        stream = await self._connector(url)
        origin = (url.scheme, url.host, url.port)
        return Connection(stream, origin=origin, max_head=self._max_head, on_idle=self._park)

    async def _park(self, connection: Connection) -> None:
        """A connection whose exchange is complete: back to the pool (with keep-alive) or closed."""
        pool = self._idle.setdefault(connection.origin, [])
        if not self._keepalive or len(pool) >= MAX_IDLE_PER_ORIGIN:
            await connection.close()
            return
        pool.append(connection)


async def fetch(
    method: str,
    url: str | URL,
    *,
    headers: Headers | Fields | None = None,
    body: bytes = b"",
    timeout: float | None = None,
    max_body: int | None = DEFAULT_MAX_BODY,
    tls: ssl.SSLContext | None = None,
    socket_factory: SocketFactory | None = None,
) -> Fetched:
    """One request on its own connection, bounded by ``timeout`` seconds (TimeoutError)."""
    client = Client(tls=tls, socket_factory=socket_factory)
    async with asyncio.timeout(timeout):
        return await client.fetch(method, url, headers=headers, body=body, max_body=max_body)
