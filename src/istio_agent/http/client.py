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
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urljoin, urlsplit

import h11

from istio_agent.http.dial import SocketFactory, Stream, open_stream
from istio_agent.http.headers import Fields, Headers

MAX_HEAD = 64 * 1024
DEFAULT_MAX_BODY = 16 * 2**20
READ_SIZE = 256 * 1024  # what an asyncio transport reads at once: one h11 event per socket read
IDLE_TIMEOUT = 60.0
"""A pooled connection idle longer than this is not reused (servers close theirs at about this age)."""
MAX_IDLE_PER_ORIGIN = 2
_DEFAULT_PORTS = {"http": 80, "https": 443}
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class HTTPError(Exception):
    """An HTTP exchange failed; the message says how (never with the body or credentials)."""


class ConnectError(HTTPError):
    """Dialing (TCP connect, or the TLS handshake) failed; ``os_error`` is why."""

    def __init__(self, address: str, os_error: OSError) -> None:
        self.address = address
        self.os_error = os_error
        super().__init__(f"cannot connect to {address}: {_describe(os_error)}")


class ProtocolError(HTTPError):
    """The response was malformed, or the connection broke before it was complete."""


class BodyTooLarge(HTTPError):
    """The response body is larger than the caller's cap."""


@dataclass(frozen=True)
class URL:
    """An absolute http(s) URL, its target kept exactly as given (nothing is re-encoded)."""

    scheme: str
    host: str
    port: int
    target: str

    @classmethod
    def parse(cls, url: str) -> URL:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as err:
            raise HTTPError(f"invalid URL {url!r}: {err}") from None
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise HTTPError(f"invalid URL {url!r}: expected http(s)://host[:port]/path")
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        return cls(scheme, parts.hostname, port or _DEFAULT_PORTS[scheme], target)

    @property
    def authority(self) -> str:
        """``host[:port]`` as the Host header carries it (no port when it is the scheme's default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == _DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def join(self, location: str) -> URL:
        """A redirect's ``Location`` resolved against this URL."""
        return URL.parse(urljoin(str(self), location))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}{self.target}"


Connector = Callable[[URL], Awaitable[Stream]]
"""Opens the stream a request to ``URL`` goes over (the default dials; tests may supply their own)."""


@dataclass(frozen=True)
class Fetched:
    """A whole response; ``truncated`` when the body was cut at the caller's cap."""

    status: int
    reason: str
    headers: Headers
    body: bytes
    truncated: bool = False

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


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
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head)
        self._max_head = max_head
        self._on_idle = on_idle
        self.idle_since = time.monotonic()

    @property
    def usable(self) -> bool:
        """Idle and still open (the server may have closed a kept-alive connection meanwhile)."""
        return self._h11.our_state is h11.IDLE and not self.stream.closing

    async def request(self, method: str, target: str, headers: Headers, body: bytes = b"") -> ClientResponse:
        """Send the request and read the response head; the body is the response's to read."""
        try:
            parts = [
                self._h11.send(
                    h11.Request(method=method, target=target.encode("latin-1"), headers=headers.raw())
                )
            ]
            if body:
                parts.extend(self._h11.send_with_data_passthrough(h11.Data(data=body)) or [])
            parts.append(self._h11.send(h11.EndOfMessage()))
        except (h11.LocalProtocolError, UnicodeEncodeError) as err:
            raise HTTPError(f"invalid request: {err}") from None
        try:
            self.stream.writer.writelines(parts)
            await self.stream.writer.drain()
        except OSError as err:
            raise ProtocolError(f"connection lost while sending the request: {_describe(err)}") from None
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response):
                break
            # InformationalResponse (100 Continue, 103 Early Hints): the final answer follows
        if sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items()) > self._max_head:
            self.abort()  # h11 only bounds a head still incomplete
            raise ProtocolError(f"response head larger than {self._max_head} bytes")
        return ClientResponse(
            self,
            status=event.status_code,
            reason=event.reason.decode("latin-1"),
            headers=Headers.from_raw(event.headers.raw_items()),
            method=method,
        )

    async def next_event(self) -> h11.Event:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as err:
                if err.error_status_hint == 431:
                    raise ProtocolError(f"response head larger than {self._max_head} bytes") from None
                raise ProtocolError(f"malformed response: {err}") from None
            if event is h11.NEED_DATA:
                try:
                    data = await self.stream.reader.read(READ_SIZE)
                except OSError as err:
                    raise ProtocolError(f"connection lost: {_describe(err)}") from None
                self._h11.receive_data(data)
                continue
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                raise ProtocolError("connection closed before the response was complete")
            return event  # type: ignore[return-value]

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
        return bytes(body)

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
            tls = self._tls if self._tls is not None else _default_tls()
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
            if not (reused and method in _IDEMPOTENT):
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
        given = headers if isinstance(headers, Headers) else Headers(headers)
        fields = Headers()
        if "Host" not in given:
            fields.add("Host", url.authority)
        for name, value in given.items():
            fields.add(name, value)
        if (body or method in _BODY_METHODS) and "Content-Length" not in fields:
            fields["Content-Length"] = str(len(body))
        if not self._keepalive and "Connection" not in fields:
            fields["Connection"] = "close"
        return fields

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


_TLS: ssl.SSLContext | None = None


def _default_tls() -> ssl.SSLContext:
    """A verifying client context, made once (loading the system's roots takes a few ms)."""
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


def _describe(err: BaseException) -> str:
    """An OSError's reason as the system says it (asyncio's connect errors carry a longer text)."""
    if isinstance(err, OSError) and not isinstance(err, ssl.SSLError):
        if err.errno and err.errno > 0:
            return os.strerror(err.errno)
        if err.strerror:  # socket.gaierror: "Name or service not known"
            return err.strerror
    return str(err) or type(err).__name__
