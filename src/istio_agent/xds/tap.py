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

Any container of the pod can reach the port, so what a connection costs is bounded: bytes are read
only as the HTTP server or the gRPC relay consumes them (TCP holds a client that streams more), at
most ``MAX_CONNECTIONS`` are held (a new one beyond closes the one quiet the longest), and the gRPC
server drops connections that never finish their handshake or stay idle (``uds.ServerLimits``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from collections.abc import Iterable
from typing import Protocol
from urllib.parse import parse_qs

import grpc

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
_COPY_SIZE = 65536
MAX_CONNECTIONS = 64
"""Connections held at once; a gRPC one costs three descriptors (the asker's and the relay's two)."""


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
    ) -> None:
        self._upstream = upstream
        self._host = host
        self._port = port
        self._http_timeout = http_timeout
        self._max_connections = max_connections
        self._core: StreamServer[None, None] = StreamServer(
            _TapSource(upstream, grpc_timeout), name="tap", log=log, describe="debug tap"
        )
        self._grpc: grpc.aio.Server | None = None
        self._grpc_port = 0
        self._http = ServerRunner(self._handle)
        self._listener: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], _TapConnection] = {}

    @property
    def port(self) -> int:
        """The bound port (the configured one, or the one picked for port 0)."""
        if self._listener is None:
            return self._port
        return int(self._listener.sockets[0].getsockname()[1])

    async def start(self) -> None:
        server = grpc.aio.server(options=ServerLimits().grpc_options())
        self._core.register(server, ADS_SERVICE, {SOTW.method: SOTW, DELTA.method: DELTA})
        self._grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._grpc = server
        try:
            self._listener = await asyncio.start_server(
                self._accept, self._host, self._port, family=socket.AF_UNSPEC
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
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.cleanup(0.5)
        await self._core.close()
        server, self._grpc = self._grpc, None
        if server is not None:
            await server.stop(0.5)

    # -- one connection: which protocol ------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connection = _TapConnection(writer)
        if len(self._connections) >= self._max_connections:
            self._evict_quietest()
        self._connections[task] = connection
        try:
            await self._serve(reader, connection)
        except asyncio.CancelledError:
            pass  # stop(): ends here, or asyncio (3.11) logs the cancelled connection task as an error
        finally:
            self._connections.pop(task, None)
            writer.close()

    def _evict_quietest(self) -> None:
        """Make room: close the connection through which nothing has moved for the longest."""
        task, quietest = min(self._connections.items(), key=lambda item: item[1].last_active)
        del self._connections[task]
        quietest.abort()
        log.debug("debug tap: %d connections held, closed the one quiet the longest", self._max_connections)

    async def _serve(self, reader: asyncio.StreamReader, connection: _TapConnection) -> None:
        """Sniff the protocol from the first bytes, then serve the connection as gRPC or HTTP."""
        try:
            first = await asyncio.wait_for(reader.readexactly(len(_H2_START)), FIRST_BYTES_TIMEOUT)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            return
        connection.touch()
        if first == _H2_START:
            await self._splice_to_grpc(first, reader, connection)
        else:
            await self._http.accept(_Sniffed(first, reader, connection), connection.writer)

    async def _splice_to_grpc(
        self, first: bytes, reader: asyncio.StreamReader, connection: _TapConnection
    ) -> None:
        """Relay the connection's bytes to the tap's gRPC server on a loopback port of its own.

        The connection ends when the gRPC server ends its side (the asker hung up, a handshake that
        never finished, an idle connection): nothing more can be said on it then.
        """
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._grpc_port)
        except OSError as err:
            log.warning("debug tap: cannot reach its gRPC server: %s", err)
            return
        connection.upstream = up_writer
        up_writer.write(first)
        sending = asyncio.ensure_future(_copy(reader, up_writer, connection))
        try:
            await _copy(up_reader, connection.writer, connection)
        finally:
            connection.writer.close()
            await asyncio.gather(sending, return_exceptions=True)
            up_writer.close()

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


class _TapConnection:
    """One asker's connection: its transports, and when bytes last moved through it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.upstream: asyncio.StreamWriter | None = None
        """The relay's connection to the tap's gRPC server, for a gRPC asker."""
        self.last_active = asyncio.get_running_loop().time()

    def touch(self) -> None:
        self.last_active = asyncio.get_running_loop().time()

    def abort(self) -> None:
        """Drop it now (its descriptors are freed at once); its task then ends on its own."""
        self.writer.transport.abort()
        if self.upstream is not None:
            self.upstream.transport.abort()


class _Sniffed:
    """The asker's reader with the sniffed bytes put back in front, for the HTTP server.

    Bytes are read only as the server asks for them, so a client that streams more than it is
    answered is held back by TCP's flow control instead of being buffered here.
    """

    def __init__(self, first: bytes, reader: asyncio.StreamReader, connection: _TapConnection) -> None:
        self._first = first
        self._reader = reader
        self._connection = connection

    async def read(self, n: int = -1) -> bytes:
        if self._first:
            data, self._first = self._first, b""
            return data
        data = await self._reader.read(n)
        self._connection.touch()
        return data


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter, connection: _TapConnection) -> None:
    """Relay one direction until ``source`` ends; then half-close ``sink`` if it is still open."""
    try:
        while data := await source.read(_COPY_SIZE):
            connection.touch()
            sink.write(data)
            await sink.drain()
        if not sink.is_closing() and sink.can_write_eof():
            sink.write_eof()
    except (ConnectionError, OSError):
        sink.close()
