"""A gRPC server on grpclib with the limits a socket every local process can reach needs.

:class:`RpcServer` serves methods (``/package.Service/Method`` -> a handler taking a
:class:`~istio_agent.rpc.call.ServerCall`) on a Unix path, a socket already listening (bound
before Envoy started), or host:port with TLS. Per connection (:class:`_GuardedProtocol`), as the
grpcio servers of the agent were configured (``uds.ServerLimits``) and as istiod's Go servers
behave:

- the client's HTTP/2 preface and SETTINGS must arrive within ``handshake_timeout`` (and, on a
  TLS port, the TLS handshake must end within it too);
- a connection without a call for ``idle_timeout`` gets GOAWAY and is closed (checked every half
  of it, so it goes between 1 and 1.5 times that after its last call);
- the server pings every ``keepalive_time`` and closes a connection whose answer does not come
  within ``keepalive_timeout`` (grpclib's keepalive);
- a client may ping down to half of ``keepalive_time``; a third ping sooner than that after the
  previous one, with no call activity in between, gets ``GOAWAY ENHANCE_YOUR_CALM`` with
  ``too_many_pings``, as gRPC's servers answer (C-core and grpc-go: two strikes);
- ``max_concurrent_streams`` is announced in SETTINGS (h2 would announce 100), and a message over
  ``max_receive_bytes`` ends its call with RESOURCE_EXHAUSTED (:mod:`istio_agent.rpc.call`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.config import Configuration
from grpclib.protocol import H2Protocol
from h2.errors import ErrorCodes
from h2.events import DataReceived, PingReceived, RemoteSettingsChanged, RequestReceived
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes

from istio_agent import keepalive
from istio_agent.rpc.call import ServerCall
from istio_agent.rpc.codec import Codec
from istio_agent.uds import ServerLimits

Cardinality = grpclib.const.Cardinality
Handler = Callable[[ServerCall], Awaitable[Any]]
"""A stream handler: reads and writes through the call; returning ends the call with OK."""
UnaryHandler = Callable[[Any, ServerCall], Awaitable[Any]]
"""A unary handler: the request and the call in, the response out."""

DEFAULT_MAX_RECEIVE_BYTES = 4 * 1024 * 1024  # gRPC's default maximum message size
MAX_PING_STRIKES = 2


@dataclass(frozen=True)
class _Method:
    handler: Handler
    request_type: Any
    response_type: Any
    cardinality: Cardinality


class RpcServer:
    """gRPC methods served with :class:`ServerLimits`; ``start`` once, ``stop`` once."""

    def __init__(
        self,
        *,
        limits: ServerLimits | None = None,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
        max_concurrent_streams: int | None = None,
    ) -> None:
        self._limits = limits or ServerLimits()
        self._max_receive_bytes = max_receive_bytes
        self._max_concurrent_streams = max_concurrent_streams
        self._methods: dict[str, _Method] = {}
        self._server: _Server | None = None

    def add_stream(self, path: str, handler: Handler, request_type: Any, response_type: Any) -> None:
        """Serve a bidirectional stream at ``path`` (``/package.Service/Method``)."""
        self._add(path, _Method(handler, request_type, response_type, Cardinality.STREAM_STREAM))

    def add_unary(self, path: str, handler: UnaryHandler, request_type: Any, response_type: Any) -> None:
        """Serve a unary method at ``path``: one request in, one response out."""

        async def unary(call: ServerCall) -> None:
            request = await call.recv()
            if request is None:
                await call.abort(grpclib.const.Status.INTERNAL, "the request has no message")
            await call.send(await handler(request, call))

        self._add(path, _Method(unary, request_type, response_type, Cardinality.UNARY_UNARY))

    def _add(self, path: str, method: _Method) -> None:
        if self._server is not None:
            raise RuntimeError("methods are added before the server starts")
        if path in self._methods:
            raise ValueError(f"two handlers for {path}")
        self._methods[path] = method

    async def start(
        self,
        *,
        sock: socket.socket | None = None,
        host: str | None = None,
        port: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Serve on ``sock`` (listening: a Unix socket from ``uds.listen``, or TCP) or on ``host:port``."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        server = _Server(self._mapping(), self._limits, self._max_concurrent_streams)
        if sock is not None:
            try:
                await server.start(sock=sock, ssl=ssl_context)
            except BaseException:
                sock.close()  # the socket was handed over: nobody else will close it
                raise
        else:
            await server.start(host, port, ssl=ssl_context)
        self._server = server

    async def start_unbound(self) -> None:
        """Serve only connections handed over with :meth:`adopt` (a port shared with another protocol)."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        self._server = _Server(self._mapping(), self._limits, self._max_concurrent_streams)

    def adopt(self, transport: asyncio.Transport, first: bytes) -> asyncio.Protocol:
        """Serve a connection accepted elsewhere, whose first bytes (``first``) were already read.

        One port can serve gRPC and HTTP/1.1 this way, without relaying to a server of its own.
        """
        if self._server is None:
            raise RuntimeError("the server is not started")
        protocol = self._server._protocol_factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if first:
            protocol.data_received(first)
        return protocol

    def sockets(self) -> list[socket.socket]:
        """The listening sockets (e.g. to learn the port bound for port 0)."""
        return self._server.listening_sockets() if self._server is not None else []

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening; calls still running after ``grace`` seconds are cancelled."""
        server, self._server = self._server, None
        if server is None:
            return
        server.stop_listening()
        if grace:
            await server.drain(grace)
        server.close()
        await server.wait_closed()
        server.close_connections()

    def _mapping(self) -> dict[str, grpclib.const.Handler]:
        return {path: self._bind(path, method) for path, method in self._methods.items()}

    def _bind(self, path: str, method: _Method) -> grpclib.const.Handler:
        max_bytes = self._max_receive_bytes

        async def serve(stream: grpclib.server.Stream[Any, Any]) -> None:
            await method.handler(ServerCall(stream, method.request_type, max_bytes))

        return grpclib.const.Handler(serve, method.cardinality, method.request_type, method.response_type)


class _Server(grpclib.server.Server):
    """grpclib's server with :class:`_GuardedProtocol` per connection."""

    def __init__(
        self, mapping: dict[str, grpclib.const.Handler], limits: ServerLimits, max_streams: int | None
    ) -> None:
        config = Configuration(
            _keepalive_time=limits.keepalive_time,
            _keepalive_timeout=limits.keepalive_timeout,
            _keepalive_permit_without_calls=True,
            _http2_max_pings_without_data=0,
            # grpclib's default (300 s) would let the server ping only once in five minutes.
            _http2_min_sent_ping_interval_without_data=limits.keepalive_time / 2,
        )
        super().__init__([_Mapping(mapping)], codec=Codec(), config=config)
        self._guard_limits = limits
        self._max_streams = max_streams
        self._protocols: set[_GuardedProtocol] = set()

    async def start(  # type: ignore[override]
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        sock: socket.socket | None = None,
        ssl: ssl.SSLContext | None = None,
    ) -> None:
        if ssl is None:
            await super().start(host, port, sock=sock)
            return
        # As grpclib's start, plus a deadline for the TLS handshake: the protocol, which enforces
        # handshake_timeout, hears of the connection only after it (asyncio's own: 60 s).
        deadline = self._guard_limits.handshake_timeout
        if sock is not None:
            self._server = await self._loop.create_server(
                self._protocol_factory, sock=sock, ssl=ssl, ssl_handshake_timeout=deadline
            )
        else:
            self._server = await self._loop.create_server(
                self._protocol_factory, host, port or 0, ssl=ssl, ssl_handshake_timeout=deadline
            )
        self._server_closed_fut = self._loop.create_future()

    def _protocol_factory(self) -> H2Protocol:
        inner = super()._protocol_factory()
        protocol = _GuardedProtocol(
            inner.handler, inner.config, inner.h2_config, self._guard_limits, self._max_streams
        )
        # Counted from connection_made on: over TLS asyncio makes the protocol before the
        # handshake and says nothing to it when the handshake fails.
        protocol.on_made = self._protocols.add
        protocol.on_lost = self._protocols.discard
        return protocol

    def close(self) -> None:
        if self._server is None:  # started unbound: only adopted connections
            for handler in self._handlers:
                handler.close()
            return
        super().close()

    async def wait_closed(self) -> None:
        if self._server is None:
            await asyncio.gather(*(handler.wait_closed() for handler in self._handlers))
            return
        await super().wait_closed()

    def listening_sockets(self) -> list[socket.socket]:
        return list(getattr(self._server, "sockets", None) or ())

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    def close_connections(self) -> None:
        """GOAWAY to every client still connected, then close (asyncio leaves accepted connections open)."""
        for protocol in list(self._protocols):
            protocol.goaway(ErrorCodes.NO_ERROR, b"server stopped")

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the calls in flight to finish."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(protocol.busy() for protocol in self._protocols) and loop.time() < deadline:
            await asyncio.sleep(0.05)


class _Mapping:
    """grpclib's servable: the method table."""

    def __init__(self, mapping: dict[str, grpclib.const.Handler]) -> None:
        self._mapping = mapping

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return self._mapping


class _GuardedProtocol(H2Protocol):
    """One connection: grpclib's protocol with a handshake deadline, idle close and a ping policy."""

    def __init__(
        self,
        handler: Any,
        config: Configuration,
        h2_config: Any,
        limits: ServerLimits,
        max_streams: int | None,
    ) -> None:
        super().__init__(handler, config, h2_config)
        self._limits = limits
        self._max_streams = max_streams
        self._timer: asyncio.TimerHandle | None = None
        self._handshaken = False
        self._last_busy = 0.0
        self._last_ping: float | None = None
        self._ping_strikes = 0
        self.on_made: Callable[[_GuardedProtocol], None] = lambda _: None
        self.on_lost: Callable[[_GuardedProtocol], None] = lambda _: None

    # -- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.on_made(self)
        if self._max_streams is not None:
            self._h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: self._max_streams})
            self.connection.flush()
        loop = asyncio.get_running_loop()
        self._last_busy = loop.time()
        self._timer = loop.call_later(self._limits.handshake_timeout, self._handshake_expired)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.on_lost(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.connection.feed(data)
        except ProtocolError:
            self.processor.close("Protocol error")
            return
        self.connection.flush()
        for event in events:
            if not self._admit(event):
                return
            self.processor.process(event)
        self.connection.flush()

    def busy(self) -> bool:
        """Whether a call is open on this connection."""
        return bool(self.processor.streams)

    @property
    def _h2(self) -> Any:
        return self.connection._connection  # grpclib keeps h2's connection here

    # -- the guards ------------------------------------------------------------------------------

    def _admit(self, event: Any) -> bool:
        """Account for one event; False when it closed the connection."""
        loop = asyncio.get_running_loop()
        if isinstance(event, RemoteSettingsChanged) and not self._handshaken:
            self._handshaken = True
            self._rearm(self._limits.idle_timeout / 2, self._check_idle)
        elif isinstance(event, (RequestReceived, DataReceived)):
            self._last_busy = loop.time()
            self._ping_strikes = 0
        elif isinstance(event, PingReceived):
            now = loop.time()
            minimum = keepalive.min_client_ping_interval(self._limits.keepalive_time)
            too_soon = self._last_ping is not None and now - self._last_ping < minimum
            self._last_ping = now
            if too_soon and not self.busy():
                self._ping_strikes += 1
                if self._ping_strikes > MAX_PING_STRIKES:
                    self.goaway(ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings")
                    return False
        return True

    def _rearm(self, delay: float, callback: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _handshake_expired(self) -> None:
        if not self._handshaken:
            self._close_transport()

    def _check_idle(self) -> None:
        now = asyncio.get_running_loop().time()
        if self.busy():
            self._last_busy = now
        elif now - self._last_busy >= self._limits.idle_timeout:
            self.goaway(ErrorCodes.NO_ERROR, b"max_idle")
            return
        self._rearm(self._limits.idle_timeout / 2, self._check_idle)

    def goaway(self, code: ErrorCodes, debug: bytes) -> None:
        try:
            self._h2.close_connection(error_code=code, additional_data=debug)
            self.connection.flush()
        except Exception:  # the connection is already broken: closing it is all that is left
            pass
        self._close_transport()

    def _close_transport(self) -> None:
        transport = getattr(self.connection, "_transport", None)
        if transport is not None:
            transport.close()
