"""The agent's debug tap: istiod's ``istio.io/debug/*`` answers on localhost, asked as the workload.

Istio's agent served this until 1.24 (``pkg/istio-agent/tap_proxy.go``): ``istioctl x ps
--xds-via-agents`` reaches each pod's port 15004 instead of istiod, and the agent puts the question
on the workload's own upstream stream, so istiod answers a caller it has authenticated
(:meth:`istio_agent.xds.proxy.XdsProxy.query`). One port serves both protocols, as Istio's h2c
server did: a connection that opens with HTTP/2's preface is gRPC ADS (SotW or Delta, served by
the stream core, 15 s per question); anything else is HTTP/1.1 ``GET /debug/<name>?resourceName=<n>``
(type ``istio.io/debug/<name>``, 5 s), answered with the response as protobuf JSON.

Errors say what happened rather than leave the asker waiting: no stream to istiod is open
(gRPC UNAVAILABLE, HTTP 503), istiod did not answer in time (DEADLINE_EXCEEDED, 504 with the
reason), or the type is not a debug type (INVALID_ARGUMENT; Istio ended such a stream silently).

Both protocols are served on the asker's own connection: :class:`_TapConnection` reads the first
bytes, then hands the connection to the gRPC server (an :class:`~istio_agent.rpc.server.RpcServer`
serving only adopted connections) or to the HTTP/1.1 server, and stays in between only to note when
bytes last came in. Nothing is relayed to a server on a port of its own.

Any container of the pod can reach the port, so what a connection costs is bounded: one descriptor;
bytes are read only as the HTTP server consumes them, or as HTTP/2's flow control lets the asker
send (TCP holds a client that streams more); a connection must say which protocol it speaks within
``FIRST_BYTES_TIMEOUT``; at most ``MAX_CONNECTIONS`` are held, gRPC or HTTP (a new one beyond closes
the one quiet the longest); and the gRPC server drops connections that never finish their handshake
or stay idle (``uds.ServerLimits``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from collections.abc import Iterable
from typing import Any, Protocol, cast
from urllib.parse import parse_qs

# Registered so istiod's answers (ClientConfig, config-dump sections) render as JSON.
from envoy.admin.v3 import config_dump_shared_pb2 as _config_dump_pb2  # noqa: F401
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.status.v3 import csds_pb2 as _csds_pb2  # noqa: F401
from google.protobuf import json_format

from istio_agent.http.messages import Request as HttpRequest
from istio_agent.http.messages import Response as HttpResponse
from istio_agent.http.messages import StreamResponse
from istio_agent.http.server import ServerRunner
from istio_agent.log import scope
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call
from istio_agent.rpc.server import RpcServer
from istio_agent.uds import ServerLimits
from istio_agent.xds.flavour import ADS_SERVICE, DELTA, SOTW, Flavour, Request, Resource
from istio_agent.xds.proxy import DEBUG_TYPE_PREFIX, TapError, TapTimeout
from istio_agent.xds.stream import Reply, Source, Stream, StreamError, StreamServer

log = scope("xdsproxy")

DEFAULT_PORT = 15004
GRPC_TIMEOUT = 15.0
HTTP_TIMEOUT = 5.0
FIRST_BYTES_TIMEOUT = 30.0
"""A connection must say which protocol it speaks within this long (Istio's ReadTimeout)."""
_H2_START = b"PRI "
"""The first four bytes of HTTP/2's connection preface; no HTTP/1.1 method begins so."""
MAX_CONNECTIONS = 64
"""Connections held at once, gRPC and HTTP together (one descriptor each)."""


class Tappable(Protocol):
    """What the tap asks: the xDS proxy's upstream (:meth:`XdsProxy.query`)."""

    async def query(
        self, request: discovery_pb2.DiscoveryRequest, timeout: float
    ) -> discovery_pb2.DiscoveryResponse: ...


class TapStartError(Exception):
    """The tap's port cannot be bound; the message names it."""


def debug_request(type_url: str, names: Iterable[str]) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=list(names))


class _TapSource(Source[None, None]):
    """Every request is a question for istiod; no node is needed (istiod sees the workload's)."""

    def __init__(self, upstream: Tappable, timeout: float) -> None:
        self._upstream = upstream
        self._timeout = timeout

    async def open(self, request: Request, call: Call, flavour: Flavour) -> None:
        return None

    def is_query(self, type_url: str) -> bool:
        return True

    async def answer(self, stream: Stream[None, None], request: Request) -> Reply:
        type_url = request.type_url
        if not type_url.startswith(DEBUG_TYPE_PREFIX):
            raise StreamError(
                Status.INVALID_ARGUMENT,
                f"the debug tap answers only {DEBUG_TYPE_PREFIX}/* types, not {type_url[:200]!r}",
            )
        question = debug_request(type_url, stream.flavour.requested_names(request))
        try:
            response = await self._upstream.query(question, self._timeout)
        except TapTimeout as err:
            raise StreamError(Status.DEADLINE_EXCEEDED, str(err)) from None
        except TapError as err:
            raise StreamError(Status.UNAVAILABLE, str(err)) from None
        return Reply(
            [Resource("", resource) for resource in response.resources],
            response.version_info,
            response.control_plane if response.HasField("control_plane") else None,
        )


def response_json(response: discovery_pb2.DiscoveryResponse) -> bytes:
    """Protobuf JSON (2-space indent) as Istio's tap; resources of unknown types as base64."""
    try:
        return json_format.MessageToJson(response, indent=2).encode()
    except (TypeError, json_format.Error):
        plain = json_format.MessageToDict(
            discovery_pb2.DiscoveryResponse(
                version_info=response.version_info, type_url=response.type_url, nonce=response.nonce
            )
        )
        plain["resources"] = [
            {"typeUrl": r.type_url, "value": base64.b64encode(r.value).decode()} for r in response.resources
        ]
        return json.dumps(plain, indent=2).encode()


class DebugTap:
    """gRPC and HTTP on one local port; questions go to ``upstream``."""

    def __init__(
        self,
        upstream: Tappable,
        port: int = DEFAULT_PORT,
        *,
        host: str = "localhost",
        grpc_timeout: float = GRPC_TIMEOUT,
        http_timeout: float = HTTP_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        limits: ServerLimits | None = None,
    ) -> None:
        self._upstream = upstream
        self._host = host
        self._port = port
        self._http_timeout = http_timeout
        self._max_connections = max_connections
        self._core: StreamServer[None, None] = StreamServer(
            _TapSource(upstream, grpc_timeout), name="tap", log=log, describe="debug tap"
        )
        self._grpc = RpcServer(limits=limits or ServerLimits())
        self._core.add_to(self._grpc, ADS_SERVICE, {SOTW.method: SOTW, DELTA.method: DELTA})
        self._http = ServerRunner(self._handle)
        self._listener: asyncio.Server | None = None
        self._connections: set[_TapConnection] = set()

    @property
    def port(self) -> int:
        """The bound port (the configured one, or the one picked for port 0)."""
        if self._listener is None:
            return self._port
        return int(self._listener.sockets[0].getsockname()[1])

    async def start(self) -> None:
        await self._grpc.start_unbound()
        loop = asyncio.get_running_loop()
        try:
            self._listener = await loop.create_server(
                lambda: _TapConnection(self), self._host, self._port, family=socket.AF_UNSPEC
            )
        except OSError as err:
            await self.stop()
            raise TapStartError(
                f"failed to start istio tap server on {self._host}:{self._port}: {err}"
            ) from None
        log.info("debug tap listening on %s:%d", self._host, self.port)

    async def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for connection in list(self._connections):
            if not connection.handed_over:
                connection.abort()  # still saying which protocol: nothing to finish
        await self._http.cleanup(0.5)
        await self._core.close()
        await self._grpc.stop(0.5)
        for connection in list(self._connections):
            connection.abort()

    # -- connections: which protocol, and how many ---------------------------------------------------

    def _opened(self, connection: _TapConnection) -> None:
        if len(self._connections) >= self._max_connections:
            self._evict_quietest()
        self._connections.add(connection)

    def _closed(self, connection: _TapConnection) -> None:
        self._connections.discard(connection)

    def _evict_quietest(self) -> None:
        """Make room: close the connection through which nothing has moved for the longest."""
        quietest = min(self._connections, key=lambda connection: connection.last_active)
        self._connections.discard(quietest)
        quietest.abort()
        log.debug("debug tap: %d connections held, closed the one quiet the longest", self._max_connections)

    def _hand_over(self, transport: asyncio.Transport, first: bytes) -> asyncio.BaseProtocol:
        """Serve the connection by its first bytes: gRPC when they open HTTP/2's preface, else HTTP."""
        if first.startswith(_H2_START):
            return self._grpc.adopt(transport, first)
        return self._http.adopt(transport, first)

    # -- HTTP --------------------------------------------------------------------------------------

    async def _handle(self, request: HttpRequest) -> StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return HttpResponse(405, text="the debug tap serves GET /debug/<type>\n")
        path = request.path
        if path != "/debug" and not path.startswith("/debug/"):
            return HttpResponse(404, text="not found: the debug tap serves GET /debug/<type>\n")
        try:
            query = parse_qs(request.query_string, strict_parsing=True) if request.query_string else {}
        except ValueError as err:
            return HttpResponse(400, text=f"bad query string: {err}\n")
        names = query.get("resourceName", [])[:1]
        type_url = "istio.io" + path
        try:
            response = await self._upstream.query(debug_request(type_url, names), self._http_timeout)
        except TapTimeout as err:
            return HttpResponse(504, text=f"{err}\n")
        except TapError as err:
            return HttpResponse(503, text=f"{err}\n")
        return HttpResponse(200, body=response_json(response), content_type="application/json")


class _TapConnection(asyncio.Protocol):
    """One asker's connection: sniffs its protocol, then stays in front of the server it was handed to.

    It forwards everything to that server's protocol unchanged and notes when bytes last came in,
    which is how the tap finds the connection quiet the longest. Flow control is the server's own:
    it pauses and resumes the transport itself.
    """

    def __init__(self, tap: DebugTap) -> None:
        self._tap = tap
        self._transport: asyncio.Transport | None = None
        self._first = b""
        self._inner: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self.last_active = asyncio.get_running_loop().time()

    @property
    def handed_over(self) -> bool:
        return self._inner is not None

    def abort(self) -> None:
        """Drop it now (its descriptor is freed at once)."""
        if self._transport is not None:
            self._transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's do not subclass asyncio's
        self._tap._opened(self)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(FIRST_BYTES_TIMEOUT, self.abort)

    def data_received(self, data: bytes) -> None:
        self.last_active = asyncio.get_running_loop().time()
        if self._inner is not None:
            self._inner.data_received(data)
            return
        self._first += data
        if len(self._first) < len(_H2_START):
            return
        assert self._transport is not None
        if self._timer is not None:
            self._timer.cancel()
        first, self._first = self._first, b""
        self._inner = self._tap._hand_over(self._transport, first)
        # Back in front, to see bytes come in and the end (also of a connection closed already).
        self._transport.set_protocol(self)

    def eof_received(self) -> bool | None:
        if self._inner is None:
            return None  # closed before it said anything
        return bool(self._inner.eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._tap._closed(self)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
