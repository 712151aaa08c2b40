"""The agent's xDS proxy: Envoy's ADS streams (SotW and Delta) relayed to istiod, one upstream each.

Behaviour follows Istio's pilot-agent (``pkg/istio-agent/xds_proxy.go``; see docs/xds.md), with
three deliberate differences:

* every downstream stream is served independently; a new stream does not close the previous one;
* memory is bounded: there are no queues, each direction awaits the write on the other side, so a
  slow reader is back-pressured through gRPC flow control (writes to one upstream call are
  serialised by a lock shared with the agent's own requests: ACKs, NDS/PCDS, health);
* an upstream failure ends the downstream stream with the upstream's status code and a text naming
  the upstream, so Envoy's own backoff drives reconnection and its log says where the problem is.

istiod's responses are relayed as the bytes received (see :mod:`istio_agent.xds.wire`); only the
agent's own types are decoded.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError

from istio_agent import uds
from istio_agent.config.xds import XdsSettings
from istio_agent.envoy import sockets
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.xds import types
from istio_agent.xds.flavour import ADS_SERVICE, DELTA, SOTW, Flavour, Request, error_detail
from istio_agent.xds.upstream import DialError, UpstreamDialer
from istio_agent.xds.wire import RawResponse

log = scope("xdsproxy")

STOP_WAIT = 5.0
"""How long stop() waits for the streams to finish their clean-up."""
_EXPECTED_UNAVAILABLE = ("client disconnected", "error reading from server: EOF", "transport is closing")
_EXPECTED_ANY = (
    "stream terminated by RST_STREAM with error code: NO_ERROR",
    "received prior goaway: code: NO_ERROR",
)


class _ProxyMetrics:
    """The xDS proxy's metrics (Istio's names)."""

    def __init__(self, registry: Registry) -> None:
        self.istiod_failures = registry.counter(
            "istiod_connection_failures", "Upstream xDS streams that failed before istiod answered."
        )
        self.istiod_terminations = registry.counter(
            "istiod_connection_terminations", "Upstream xDS streams that ended, by kind.", ["type"]
        )
        self.envoy_terminations = registry.counter(
            "envoy_connection_terminations", "Downstream xDS streams ended by Envoy, by kind.", ["type"]
        )
        self.requests = registry.counter(
            "xds_proxy_requests", "xDS requests sent to istiod (Envoy's and the agent's)."
        )
        self.responses = registry.counter("xds_proxy_responses", "xDS responses received from istiod.")
        self.recv_max = registry.gauge(
            "pilot_xds_recv_max", "Largest xDS request received from Envoy, in bytes."
        )
        self.connections = registry.gauge("xds_proxy_connections", "Open downstream xDS streams.")
        self.nacks = registry.counter(
            "xds_proxy_nacks", "Responses rejected by Envoy (NACKs seen on the way up).", ["type_url"]
        )
        self.pushes = registry.counter("xds_proxy_pushes", "Responses forwarded to Envoy.", ["type_url"])


DEBUG_TYPE_PREFIX = "istio.io/debug"


class TapError(Exception):
    """A debug question could not be asked on the workload's connection to istiod."""


class TapTimeout(TapError):
    """istiod did not answer a debug question in time (or the stream ended first)."""


@dataclass(eq=False)
class _TapWait:
    stream_id: int
    type_url: str
    answer: asyncio.Future[discovery_pb2.DiscoveryResponse]


def as_sotw_response(flavour: Flavour, raw: RawResponse) -> discovery_pb2.DiscoveryResponse:
    """A debug answer in SotW form whatever the stream's flavour (Istio's tap converts Delta too)."""
    if not flavour.delta:
        return discovery_pb2.DiscoveryResponse.FromString(raw.data)
    delta = discovery_pb2.DeltaDiscoveryResponse.FromString(raw.data)
    return discovery_pb2.DiscoveryResponse(
        version_info=delta.system_version_info,
        resources=[resource.resource for resource in delta.resources],
        type_url=delta.type_url,
        nonce=delta.nonce,
        control_plane=delta.control_plane if delta.HasField("control_plane") else None,
    )


class TypeHandler(Protocol):
    """An agent-owned type: its responses go to ``handle`` instead of Envoy."""

    type_url: str

    def handle(self, resource: any_pb2.Any) -> None:
        """Consume the resource; raise ValueError(text) to NACK it."""


def classify(code: grpc.StatusCode, details: str) -> str:
    """Istio's GRPCErrorType as a metric label: ``cancelled`` (graceful or expected) or ``error``."""
    if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return "cancelled"
    if code == grpc.StatusCode.UNAVAILABLE and any(text in details for text in _EXPECTED_UNAVAILABLE):
        return "cancelled"
    if any(text in details for text in _EXPECTED_ANY):
        return "cancelled"
    return "error"


def _open_upstream(flavour: Flavour, channel: grpc.aio.Channel, metadata: list[tuple[str, str]]) -> Any:
    """The upstream stream; responses arrive as :class:`RawResponse` (bytes plus their type URL)."""
    method = channel.stream_stream(
        f"/{ADS_SERVICE}/{flavour.method}",
        request_serializer=flavour.request_type.SerializeToString,
        response_deserializer=RawResponse.decode,
    )
    return method(metadata=metadata, wait_for_ready=False)


# -- per-stream state and outcomes -----------------------------------------------------------------
class _UpstreamError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _DownstreamError(Exception):
    """Envoy's side of the stream broke (read or write failed)."""


@dataclass(frozen=True)
class _Outcome:
    """How a downstream stream ends: the status sent to Envoy (None: Envoy is gone, send nothing)."""

    code: grpc.StatusCode | None = grpc.StatusCode.OK
    details: str = ""


@dataclass(eq=False)
class _Stream:
    id: int
    flavour: Flavour
    call: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    health_wake: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: tuple[asyncio.Task[None], ...] = ()
    initial_sent: bool = False
    answered: bool = False
    """istiod has sent at least one response on this stream (the connection attempt succeeded)."""
    half_closed: bool = False
    stopping: bool = False

    def shutdown(self) -> None:
        self.stopping = True
        for task in self.tasks:
            task.cancel()


class XdsProxy:
    """ADS server on a Unix socket for Envoy; each stream relayed to its own upstream stream to istiod."""

    def __init__(
        self,
        settings: XdsSettings,
        *,
        handlers: Sequence[TypeHandler] = (),
        dialer: UpstreamDialer | None = None,
        registry: Registry,
        limits: uds.ServerLimits | None = None,
        listener: sockets.Listener | None = None,
    ) -> None:
        """``limits``: how long connections from Envoy's side that do nothing are kept; by default
        the server pings every GRPC_KEEPALIVE_INTERVAL and waits GRPC_KEEPALIVE_TIMEOUT, as Istio's.

        ``listener``: ``settings.socket_path``, already listening (bound before Envoy started, with
        its own limits); without one, ``start`` binds it."""
        self._settings = settings
        self._limits = limits or sockets.xds_limits(settings)
        self._listener = listener
        self._metrics = _ProxyMetrics(registry)
        self._handlers: dict[str, TypeHandler] = {}
        for handler in handlers:
            if handler.type_url in self._handlers:
                raise ValueError(f"two handlers for {handler.type_url}")
            self._handlers[handler.type_url] = handler
        self._dialer = dialer or UpstreamDialer(settings)
        self._server: grpc.aio.Server | None = None
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self._health: tuple[discovery_pb2.DiscoveryRequest, discovery_pb2.DeltaDiscoveryRequest] | None = None
        self._failed_attempts = 0
        self._last_failure = ""
        self._recv_max = 0
        self._stopping = False
        self._tap_lock = asyncio.Lock()
        self._tap: _TapWait | None = None

    @property
    def socket_path(self) -> Path:
        return self._settings.socket_path

    def active_streams(self) -> int:
        return len(self._streams)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve on the listener, or listen on the socket (replacing any stale file, open to every local user)."""
        if self._server is not None:
            raise RuntimeError("xDS proxy already started")
        listener, self._listener = self._listener, None
        if listener is None:
            listener = await sockets.listen_xds(self._settings, self._limits)
        server = listener.take()
        server.add_generic_rpc_handlers((self._rpc_handlers(),))
        await server.start()
        self._server = server
        self._stopping = False
        log.info("xDS proxy listening on %s, upstream %s", self.socket_path, self._dialer.describe())

    async def stop(self) -> None:
        """End every stream (OK to Envoy, upstream cancelled and closed), then stop the server."""
        self._stopping = True
        streams = list(self._streams.values())
        for stream in streams:
            stream.shutdown()
        if streams:
            waiting = asyncio.gather(*(stream.finished.wait() for stream in streams))
            try:
                await asyncio.wait_for(waiting, STOP_WAIT)
            except TimeoutError:
                log.warning(
                    "xDS proxy: %d stream(s) did not finish within %.0fs", len(self._streams), STOP_WAIT
                )
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0.5)
            log.info("xDS proxy stopped")

    def _rpc_handlers(self) -> grpc.GenericRpcHandler:
        """ADS with Envoy's requests decoded and istiod's responses written as received (no re-encoding)."""

        def handler(flavour: Flavour) -> grpc.RpcMethodHandler:
            async def serve(requests: AsyncIterator[Request], context: grpc.aio.ServicerContext) -> None:
                await self.serve(flavour, requests, context)

            return grpc.stream_stream_rpc_method_handler(
                serve,
                request_deserializer=flavour.request_type.FromString,
                response_serializer=RawResponse.encode,
            )

        return grpc.method_handlers_generic_handler(
            ADS_SERVICE, {flavour.method: handler(flavour) for flavour in (SOTW, DELTA)}
        )

    # -- health ---------------------------------------------------------------------------------------
    def report_health(self, healthy: bool, message: str = "") -> None:
        """Store the workload's health and send it on every stream past its first LDS request.

        The stored report is also sent after the first LDS request of every later stream, so
        istiod learns the current state after a reconnect.
        """
        detail = error_detail(None if healthy else message)
        self._health = (
            discovery_pb2.DiscoveryRequest(type_url=types.HEALTH_INFO, error_detail=detail),
            discovery_pb2.DeltaDiscoveryRequest(type_url=types.HEALTH_INFO, error_detail=detail),
        )
        for stream in self._streams.values():
            stream.health_wake.set()

    def _health_request(self, stream: _Stream) -> Request | None:
        if self._health is None:
            return None
        return self._health[1] if stream.flavour is DELTA else self._health[0]

    # -- debug questions (the agent's tap) ------------------------------------------------------------
    async def query(
        self, request: discovery_pb2.DiscoveryRequest, timeout: float
    ) -> discovery_pb2.DiscoveryResponse:
        """Ask istiod an ``istio.io/debug/*`` question on the newest upstream stream, so istiod sees
        the workload's own identity (Istio's tap does the same), and return its answer.

        One question at a time, as in Istio. The asker's node is dropped: the stream has identified
        itself already. The answer is not ACKed. Raises :class:`TapError` when no stream is open
        and :class:`TapTimeout` when istiod does not answer within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                return await self._query(request)
        except TimeoutError:
            raise TapTimeout(f"istiod did not answer {request.type_url} within {timeout:g}s") from None

    async def _query(self, request: discovery_pb2.DiscoveryRequest) -> discovery_pb2.DiscoveryResponse:
        async with self._tap_lock:
            stream = next(
                (s for s in reversed(self._streams.values()) if s.call is not None and not s.half_closed),
                None,
            )
            if stream is None:
                raise TapError("proxy not connected to Istiod")
            names = list(request.resource_names)
            question: Request = (
                discovery_pb2.DeltaDiscoveryRequest(type_url=request.type_url, resource_names_subscribe=names)
                if stream.flavour is DELTA
                else discovery_pb2.DiscoveryRequest(type_url=request.type_url, resource_names=names)
            )
            wait = _TapWait(stream.id, request.type_url, asyncio.get_running_loop().create_future())
            self._tap = wait
            ended = asyncio.create_task(stream.finished.wait())
            try:
                try:
                    await self._send_upstream(stream, question)
                except _UpstreamError as err:
                    raise TapError(f"xDS upstream {self._dialer.describe()}: {err.details}") from None
                await asyncio.wait((wait.answer, ended), return_when=asyncio.FIRST_COMPLETED)
                if wait.answer.done():
                    return wait.answer.result()
                raise TapTimeout(f"the stream to istiod ended before it answered {request.type_url}")
            finally:
                self._tap = None
                ended.cancel()

    def _tap_answer(self, stream: _Stream, raw: RawResponse) -> None:
        wait = self._tap
        if wait is None or wait.stream_id != stream.id or wait.type_url != raw.type_url or wait.answer.done():
            log.debug("tap response %s arrived too late; discarding", raw.type_url)
            return
        try:
            wait.answer.set_result(as_sotw_response(stream.flavour, raw))
        except DecodeError as err:
            wait.answer.set_exception(TapError(f"malformed {raw.type_url} response from istiod: {err}"))

    # -- one downstream stream ------------------------------------------------------------------------
    async def serve(
        self, flavour: Flavour, requests: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> None:
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "xDS proxy is shutting down")
        stream = _Stream(next(self._ids), flavour)
        self._streams[stream.id] = stream
        self._metrics.connections.inc()
        log.debug("Envoy opened %s xDS stream %d", flavour.name, stream.id)
        outcome = _Outcome(None)
        try:
            outcome = await self._relay(stream, requests, context)
        except asyncio.CancelledError:
            self._metrics.envoy_terminations.labels(type="cancelled").inc()
            log.debug("%s xDS stream %d: cancelled by Envoy", flavour.name, stream.id)
            raise
        finally:
            del self._streams[stream.id]
            self._metrics.connections.dec()
            stream.finished.set()
        if outcome.code is None:
            return
        log.debug(
            "%s xDS stream %d ended: %s %s", flavour.name, stream.id, outcome.code.name, outcome.details
        )
        if outcome.code != grpc.StatusCode.OK:
            await context.abort(outcome.code, outcome.details)

    async def _relay(
        self, stream: _Stream, requests: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> _Outcome:
        try:
            channel = self._dialer.dial()
        except DialError as err:
            self._metrics.istiod_failures.inc()
            self._note_failure(str(err))
            return _Outcome(grpc.StatusCode.UNAVAILABLE, f"xDS upstream {self._dialer.describe()}: {err}")
        try:
            stream.call = _open_upstream(stream.flavour, channel, self._dialer.metadata())
            stream.tasks = (
                asyncio.create_task(self._pump_requests(stream, requests), name=f"xds-{stream.id}-requests"),
                asyncio.create_task(self._pump_responses(stream, context), name=f"xds-{stream.id}-responses"),
                asyncio.create_task(self._pump_health(stream), name=f"xds-{stream.id}-health"),
            )
            return self._settle(stream, await self._first_outcome(stream))
        finally:
            # Shielded: a second cancellation (server stopping) must not leave the channel open.
            await asyncio.shield(self._close_upstream(stream, channel))

    async def _first_outcome(self, stream: _Stream) -> BaseException | None:
        """The exception that ends the relay, or None when istiod ended the stream with OK."""
        responses = stream.tasks[1]
        pending = set(stream.tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    return asyncio.CancelledError()  # stop(): end the stream cleanly
                error = task.exception()
                if error is not None:
                    return error
                if task is responses:
                    return None
                # Envoy half-closed its side: keep relaying what istiod still sends.
        return None

    def _settle(self, stream: _Stream, error: BaseException | None) -> _Outcome:
        """Count and log how the stream ended; the status for Envoy."""
        name = f"{stream.flavour.name} xDS stream {stream.id}"
        if stream.stopping or isinstance(error, asyncio.CancelledError):
            return _Outcome(grpc.StatusCode.OK)
        if error is None:
            self._metrics.istiod_terminations.labels(type="cancelled").inc()
            log.debug("%s: upstream %s closed the stream", name, self._dialer.address)
            return _Outcome(grpc.StatusCode.OK)
        if isinstance(error, _UpstreamError):
            details = f"xDS upstream {self._dialer.describe()}: {error.details}"
            kind = classify(error.code, error.details)
            if not stream.answered:
                self._metrics.istiod_failures.inc()
                self._note_failure(f"{error.code.name}: {error.details}")
            else:
                self._metrics.istiod_terminations.labels(type=kind).inc()
                level = log.debug if kind == "cancelled" else log.warning
                level(
                    "%s: upstream %s ended the stream: %s: %s",
                    name,
                    self._dialer.address,
                    error.code.name,
                    error.details,
                )
            return _Outcome(error.code, details)
        if isinstance(error, _DownstreamError):
            self._metrics.envoy_terminations.labels(type="error").inc()
            log.warning("%s: Envoy side failed: %s", name, error)
            return _Outcome(None)
        log.error("%s: internal error", name, exc_info=error)
        return _Outcome(grpc.StatusCode.INTERNAL, f"xDS proxy internal error: {type(error).__name__}")

    async def _close_upstream(self, stream: _Stream, channel: grpc.aio.Channel) -> None:
        for task in stream.tasks:
            task.cancel()
        if stream.tasks:
            await asyncio.gather(*stream.tasks, return_exceptions=True)
        if stream.call is not None and not stream.call.done():
            stream.call.cancel()
            self._metrics.istiod_terminations.labels(type="cancelled").inc()
        await channel.close()

    # -- reconnect logging ----------------------------------------------------------------------------
    def _note_failure(self, reason: str) -> None:
        """First failure of a run at warning; the same failure again only at debug, with a count."""
        self._failed_attempts += 1
        if self._failed_attempts == 1 or reason != self._last_failure:
            log.warning("cannot connect to xDS upstream %s: %s", self._dialer.describe(), reason)
        else:
            log.debug(
                "still cannot connect to xDS upstream %s (%d failed attempts): %s",
                self._dialer.address,
                self._failed_attempts,
                reason,
            )
        self._last_failure = reason

    def _note_success(self) -> None:
        if self._failed_attempts:
            log.info("connected to %s after %d failed attempts", self._dialer.address, self._failed_attempts)
        self._failed_attempts = 0
        self._last_failure = ""

    # -- request path: Envoy -> istiod ----------------------------------------------------------------
    async def _pump_requests(self, stream: _Stream, requests: AsyncIterator[Request]) -> None:
        iterator = aiter(requests)
        while True:
            try:
                request = await anext(iterator)
            except StopAsyncIteration:
                break
            except grpc.RpcError as err:
                raise _DownstreamError(f"read failed: {err}") from None
            self._observe(request)
            await self._send_upstream(stream, request)
            if not stream.initial_sent and request.type_url == types.LISTENER:
                await self._send_initial_requests(stream)
        # Envoy half-closed: pass it on; istiod ends the stream and so do we.
        stream.half_closed = True
        async with stream.lock:
            if not stream.call.done():
                await stream.call.done_writing()

    def _observe(self, request: Request) -> None:
        size = request.ByteSize()
        if size > self._recv_max:
            self._recv_max = size
            self._metrics.recv_max.set(size)
        if request.HasField("error_detail"):
            self._metrics.nacks.labels(type_url=request.type_url).inc()
            log.debug("Envoy rejected %s: %s", request.type_url, request.error_detail.message)

    async def _send_initial_requests(self, stream: _Stream) -> None:
        """After the first LDS request: subscribe to the agent's own types, then report health."""
        order = [types.NAME_TABLE, types.PROXY_CONFIG]
        order += [url for url in self._handlers if url not in order]
        for type_url in order:
            if type_url in self._handlers:
                await self._send_upstream(stream, stream.flavour.agent_request(type_url))
        stream.initial_sent = True
        health = self._health_request(stream)
        if health is not None:
            await self._send_upstream(stream, health)

    async def _pump_health(self, stream: _Stream) -> None:
        while True:
            await stream.health_wake.wait()
            stream.health_wake.clear()
            health = self._health_request(stream)
            # Before the first LDS request the report waits: it is sent with the initial requests.
            if stream.initial_sent and health is not None:
                await self._send_upstream(stream, health)

    async def _send_upstream(self, stream: _Stream, request: Request) -> None:
        async with stream.lock:
            if stream.half_closed:
                log.debug(
                    "stream %d: not sending %s after Envoy closed its side", stream.id, request.type_url
                )
                return
            try:
                await stream.call.write(request)
            except grpc.RpcError as err:
                raise await self._upstream_error(stream, err) from None
            except asyncio.InvalidStateError as err:
                raise await self._upstream_error(stream, err) from None
        self._metrics.requests.inc()

    async def _upstream_error(self, stream: _Stream, err: Exception) -> _UpstreamError:
        if isinstance(err, grpc.aio.AioRpcError):
            return _UpstreamError(err.code(), err.details() or "")
        code = await stream.call.code()
        details = await stream.call.details()
        if code == grpc.StatusCode.OK:
            return _UpstreamError(grpc.StatusCode.UNAVAILABLE, f"stream closed while sending: {err}")
        return _UpstreamError(code, details or "")

    # -- response path: istiod -> Envoy ---------------------------------------------------------------
    async def _pump_responses(self, stream: _Stream, context: grpc.aio.ServicerContext) -> None:
        call = stream.call
        while True:
            try:
                response = await call.read()
            except grpc.RpcError as err:
                raise await self._upstream_error(stream, err) from None
            if response is grpc.aio.EOF:
                return
            if response.malformed:
                raise _UpstreamError(grpc.StatusCode.INTERNAL, f"malformed response: {response.malformed}")
            if not stream.answered:
                stream.answered = True
                self._note_success()
            self._metrics.responses.inc()
            handler = self._handlers.get(response.type_url)
            if response.type_url.startswith(DEBUG_TYPE_PREFIX):
                self._tap_answer(stream, response)
            elif handler is not None:
                await self._handle_agent_type(stream, handler, response)
            elif not types.is_forwardable(response.type_url):
                log.debug(
                    "skipping forwarding type url %s to Envoy: not a valid Envoy type", response.type_url
                )
            else:
                try:
                    await context.write(response)
                except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as err:
                    raise _DownstreamError(f"write failed: {err}") from None
                self._metrics.pushes.labels(type_url=response.type_url).inc()

    async def _handle_agent_type(self, stream: _Stream, handler: TypeHandler, raw: RawResponse) -> None:
        try:
            response = stream.flavour.response_type.FromString(raw.data)
        except DecodeError as err:
            raise _UpstreamError(
                grpc.StatusCode.INTERNAL, f"malformed {raw.type_url} response: {err}"
            ) from None
        resource = stream.flavour.first_resource(response)
        if resource is None:
            log.debug("empty %s response from istiod: nothing to do, no ACK", response.type_url)
            return
        error: str | None = None
        try:
            handler.handle(resource)
        except ValueError as err:
            error = str(err) or type(err).__name__
        except Exception as err:
            log.exception("handler for %s failed", response.type_url)
            error = f"{type(err).__name__}: {err}"
        if error is not None:
            log.warning("rejecting %s from istiod: %s", response.type_url, error)
        await self._send_upstream(stream, stream.flavour.reply(response, error))
