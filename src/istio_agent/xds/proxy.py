"""The agent's xDS proxy: Envoy's ADS streams (SotW and Delta) relayed to istiod, one upstream each.

Behaviour follows Istio's pilot-agent (``pkg/istio-agent/xds_proxy.go``; see docs/xds.md), with
three deliberate differences:

* every downstream stream is served independently; a new stream does not close the previous one;
* memory is bounded: there are no queues but the one of ECDS responses waiting for their Wasm
  modules (see :mod:`istio_agent.xds.relay`);
* an upstream failure ends the downstream stream with the upstream's status code and a text naming
  the upstream, so Envoy's own backoff drives reconnection and its log says where the problem is
  (see :mod:`istio_agent.xds.outcome`).

This module is the server: it owns the streams and wires the parts together: the relay, the
outcomes, the health reports (:mod:`~istio_agent.xds.health_report`), the debug tap's questions
(:mod:`~istio_agent.xds.questions`), the ECDS conversion (:mod:`~istio_agent.xds.extension_configs`)
and the metrics (:mod:`~istio_agent.xds.proxy_metrics`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from envoy.service.discovery.v3 import discovery_pb2
from grpclib.exceptions import GRPCError

from istio_agent import uds
from istio_agent.config.xds import XdsSettings
from istio_agent.envoy import sockets
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call, CallEnded
from istio_agent.rpc.server import RpcServer
from istio_agent.xds.extension_configs import ExtensionConfigs
from istio_agent.xds.flavour import ADS_SERVICE, DELTA, SOTW, Flavour
from istio_agent.xds.health_report import HealthReport
from istio_agent.xds.outcome import Outcome, Outcomes
from istio_agent.xds.proxy_metrics import ProxyMetrics
from istio_agent.xds.proxy_stream import ProxyStream
from istio_agent.xds.questions import DEBUG_TYPE_PREFIX, DebugQuestions, TapError, TapTimeout
from istio_agent.xds.relay import Relay, TypeHandler
from istio_agent.xds.upstream import UpstreamDialer

__all__ = ["DEBUG_TYPE_PREFIX", "STOP_WAIT", "TapError", "TapTimeout", "XdsProxy"]
"""The tap's names stay here for xds/tap.py, which imports them from this module."""

log = scope("xdsproxy")

STOP_WAIT = 5.0
"""How long stop() waits for the streams to finish their clean-up."""


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
        self._metrics = ProxyMetrics(registry)
        by_type: dict[str, TypeHandler] = {}
        for handler in handlers:
            if handler.type_url in by_type:
                raise ValueError(f"two handlers for {handler.type_url}")
            by_type[handler.type_url] = handler
        self._dialer = dialer or UpstreamDialer(settings)
        self._server: RpcServer | None = None
        self._streams: dict[int, ProxyStream] = {}
        self._ids = itertools.count(1)
        self._health = HealthReport()
        self._questions = DebugQuestions(self._streams, self._dialer.describe)
        self._extension_configs = (
            ExtensionConfigs(settings.wasm, registry) if settings.wasm is not None else None
        )
        self._relay = Relay(
            dialer=self._dialer,
            handlers=by_type,
            metrics=self._metrics,
            health=self._health,
            questions=self._questions,
            outcomes=Outcomes(self._metrics, self._dialer),
            extension_configs=self._extension_configs,
        )
        self._stopping = False

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
            listener = await sockets.listen_xds(self._settings)
        server = RpcServer(
            limits=self._limits,
            max_receive_bytes=self._settings.max_recv_bytes,
            max_concurrent_streams=self._settings.max_streams,
        )
        for flavour in (SOTW, DELTA):
            # Envoy's requests decoded; istiod's responses written as the bytes received (no re-encoding).
            server.add_stream(
                f"/{ADS_SERVICE}/{flavour.method}", self._handler(flavour), flavour.request_type, bytes
            )
        await server.start(sock=listener.take())
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
                async with asyncio.timeout(STOP_WAIT):
                    await waiting
            except TimeoutError:
                log.warning(
                    "xDS proxy: %d stream(s) did not finish within %.0fs", len(self._streams), STOP_WAIT
                )
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0.5)
            self.socket_path.unlink(missing_ok=True)  # as Go's listener (and grpcio) remove theirs
            log.info("xDS proxy stopped")
        if self._extension_configs is not None:
            await self._extension_configs.stop()

    def _handler(self, flavour: Flavour) -> Callable[[Call], Awaitable[None]]:
        async def serve(call: Call) -> None:
            await self.serve(flavour, call)

        return serve

    # -- what the rest of the agent asks of the streams -------------------------------------------------
    def report_health(self, healthy: bool, message: str = "") -> None:
        """Store the workload's health and send it on every stream past its first LDS request.

        The stored report is also sent after the first LDS request of every later stream, so
        istiod learns the current state after a reconnect.
        """
        self._health.update(healthy, message)
        for stream in self._streams.values():
            stream.health_wake.set()

    async def query(
        self, request: discovery_pb2.DiscoveryRequest, timeout: float
    ) -> discovery_pb2.DiscoveryResponse:
        """Ask istiod an ``istio.io/debug/*`` question on the newest upstream stream, so istiod sees
        the workload's own identity (Istio's tap does the same), and return its answer.

        Raises :class:`TapError` when no stream is open and :class:`TapTimeout` when istiod does
        not answer within ``timeout`` seconds (see :class:`~istio_agent.xds.questions.DebugQuestions`)."""
        return await self._questions.ask(request, timeout, self._relay.send)

    # -- one downstream stream ------------------------------------------------------------------------
    async def serve(self, flavour: Flavour, call: Call) -> None:
        # The first request is read before anything can refuse the stream: grpcio's client (a
        # proxyless app) reports a stream reset after its status as INTERNAL when its data was unread.
        requests = aiter(call)
        try:
            first = await anext(requests)
        except (StopAsyncIteration, CallEnded):
            return
        except GRPCError as err:
            await call.abort(err.status, err.message or "")
        if self._stopping:
            await call.abort(Status.UNAVAILABLE, "xDS proxy is shutting down")
        stream = ProxyStream(next(self._ids), flavour)
        self._streams[stream.id] = stream
        self._metrics.connections.inc()
        log.debug("Envoy opened %s xDS stream %d", flavour.name, stream.id)
        outcome = Outcome(None)
        try:
            outcome = await self._relay.run(stream, call, first, requests)
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
        if outcome.code is not Status.OK:
            await call.abort(outcome.code, outcome.details)
