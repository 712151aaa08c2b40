"""The local control plane's Aggregated Discovery Service: SotW and Delta ADS, plus istiod's syncz.

The protocol rules are istiod's (xds.md 2 and 4.2), because Envoy's ACK, NACK and reconnect
behaviour is tuned against them. A NACK is recorded and never answered, so a rejected config
cannot turn into a NACK loop. A stale nonce is ignored.

Each stream runs three tasks. The gRPC handler validates the first request, awaits the
authorizer and then waits. A reader puts requests into a small bounded queue, so gRPC flow
control back-pressures a chatty client. A worker is the only task that changes the stream's
state or writes to it. It handles requests first, then the connection's one pending-push slot.
:meth:`AdsServer.update_mesh` only fills that slot (the newest mesh wins) and returns, so a
client that stops reading stalls its own worker and nobody else's, and holds at most one
pending mesh.

Per-type state (sent nonce and version) is recorded when a response is built, before it is
written. The worker writes it before it reads the next request, so an ACK can only match a
nonce the client could have received.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol, TypeAlias

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import any_pb2, timestamp_pb2
from google.protobuf.message import Message

from istio_agent import __version__, metrics
from istio_agent.controlplane.mesh import MeshConfig
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NAME_TABLE_TYPE,
    ROUTE_TYPE,
    ProxyNode,
    Snapshot,
    resource_version,
)
from istio_agent.log import scope

log = scope("ads")

SYNCZ_TYPE = "istio.io/debug/syncz"
PUSH_ORDER = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, NAME_TABLE_TYPE)
"""The served types, in the order pushes go out: make before break (clusters before their users)."""
WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE, NAME_TABLE_TYPE})
"""Types a client gets in full; EDS and RDS serve only the names asked for."""
SYNCZ_METADATA = ("CLUSTER_ID", "NAMESPACE", "ISTIO_VERSION")
REQUEST_QUEUE_SIZE = 8
_MAX_ERROR_TEXT = 1024
"""NACK messages come from the client; logs and status keep at most this much of one."""

SnapshotFn = Callable[[MeshConfig, ProxyNode], Snapshot]
Authorizer = Callable[[grpc.aio.ServicerContext, ProxyNode], Awaitable[None]]
"""Awaited once per stream with the proxy's node; refuses by aborting the context."""

xds_connections = metrics.gauge(
    "controlplane_xds_connections", "Open ADS streams on the local control plane.", ["flavour"]
)
xds_pushes = metrics.counter(
    "controlplane_xds_pushes", "Discovery responses the local control plane sent, by type.", ["type_url"]
)
xds_nacks = metrics.counter(
    "controlplane_xds_nacks", "Discovery responses clients rejected (NACK), by type.", ["type_url"]
)
xds_unknown_type = metrics.counter(
    "controlplane_xds_unknown_type", "Discovery requests for a type the local control plane does not serve."
)


class PushObserver(Protocol):
    """Optional hooks to time pushes (the benchmark); ``at`` is ``time.monotonic()``."""

    def pushed(self, conn_id: int, type_url: str, nonce: str, resources: int, at: float) -> None:
        """A response was written to the stream (``resources``: how many it carried)."""

    def acked(self, conn_id: int, type_url: str, nonce: str, at: float, error: str | None) -> None:
        """The client answered the last response of a type: ACK (``error`` None) or NACK."""


@dataclass(frozen=True)
class TypeStatus:
    """One subscribed type of one stream, as :meth:`AdsServer.connections` reports it."""

    type_url: str
    sent_nonce: str
    acked_nonce: str
    version: str
    """version_info (SotW) or system_version_info (Delta) of the last response."""
    error: str | None
    """The message of the client's NACK of the last response; None once it ACKs."""
    last_sent: float | None
    """Wall-clock time (``time.time()``) of the last response."""
    resources: int
    """Resources the client holds according to what was sent."""

    @property
    def config_status(self) -> str:
        """istiod's syncz status: ERROR, NOT_SENT, SYNCED or STALE."""
        if self.error is not None:
            return "ERROR"
        if not self.sent_nonce:
            return "NOT_SENT"
        return "SYNCED" if self.acked_nonce == self.sent_nonce else "STALE"


@dataclass(frozen=True)
class ConnectionStatus:
    """One open ADS stream: who, which flavour, and where each type stands."""

    conn_id: int
    node_id: str
    flavour: str
    """"sotw" or "delta"."""
    types: dict[str, TypeStatus]
    last_error: str | None
    """The most recent NACK message on any type of this stream."""


class _StreamFailure(Exception):
    """Ends the stream with ``code``; raised inside the worker, turned into a status by the handler."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class _View:
    """A proxy's snapshot with every resource's version, computed once per mesh."""

    mesh: MeshConfig
    resources: dict[str, dict[str, Message]]
    versions: dict[str, dict[str, str]]


@dataclass
class _TypeState:
    """Per-type protocol state of one stream."""

    type_url: str
    names: set[str] = field(default_factory=set)
    """SotW: the names asked for (EDS/RDS). Delta: explicitly subscribed names."""
    wildcard: bool = False
    client_versions: dict[str, str] = field(default_factory=dict)
    """Delta: name -> version the client holds (initial versions, then what was sent)."""
    sent_nonce: str = ""
    acked_nonce: str = ""
    version: str = ""
    error: str | None = None
    last_sent: float | None = None
    resources: int = 0

    def sent(self, nonce: str, version: str, resources: int) -> None:
        self.sent_nonce = nonce
        self.version = version
        self.last_sent = time.time()
        self.resources = resources

    def status(self) -> TypeStatus:
        return TypeStatus(
            type_url=self.type_url,
            sent_nonce=self.sent_nonce,
            acked_nonce=self.acked_nonce,
            version=self.version,
            error=self.error,
            last_sent=self.last_sent,
            resources=self.resources,
        )


Response: TypeAlias = discovery_pb2.DiscoveryResponse | discovery_pb2.DeltaDiscoveryResponse


class _Connection:
    """One ADS stream: its proxy, per-type state, request queue and pending-push slot."""

    def __init__(self, conn_id: int, proxy: ProxyNode, flavour: str) -> None:
        self.id = conn_id
        self.proxy = proxy
        self.flavour = flavour
        self.types: dict[str, _TypeState] = {}
        self.view: _View | None = None
        self.requests: asyncio.Queue[Any] = asyncio.Queue(REQUEST_QUEUE_SIZE)
        self.reader_done = False
        self.pending_mesh: MeshConfig | None = None
        self.wake = asyncio.Event()
        self.done = asyncio.Event()
        """Set when the stream should end: the worker finished, or the server is closing."""
        self.tasks: list[asyncio.Task[None]] = []
        """The reader and the worker."""
        self.failure: _StreamFailure | None = None
        self.last_error: str | None = None
        self.warned_unknown = False

    @property
    def delta(self) -> bool:
        return self.flavour == "delta"

    def status(self) -> ConnectionStatus:
        return ConnectionStatus(
            conn_id=self.id,
            node_id=self.proxy.id,
            flavour=self.flavour,
            types={url: state.status() for url, state in sorted(self.types.items())},
            last_error=self.last_error,
        )


def _nonce() -> str:
    return uuid.uuid4().hex


def _content_version(pairs: Iterable[tuple[str, str]]) -> str:
    """A stable version of a set of resources: hash over their sorted (name, version) pairs."""
    digest = hashlib.sha256()
    for name, version in sorted(pairs):
        digest.update(f"{name}\0{version}\n".encode())
    return digest.hexdigest()[:16]


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _error_text(request: Any) -> str:
    message = str(request.error_detail.message) or f"code {request.error_detail.code}"
    return message[:_MAX_ERROR_TEXT]


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it always raises


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """ADS for every proxy, from ``snapshot_fn(mesh, proxy)``; :meth:`update_mesh` pushes changes."""

    def __init__(
        self,
        mesh: MeshConfig,
        snapshot_fn: SnapshotFn,
        *,
        authorize: Authorizer | None = None,
        control_plane_id: str = "agentctl-controlplane",
        observer: PushObserver | None = None,
    ) -> None:
        self._mesh = mesh
        self._snapshot_fn = snapshot_fn
        self._authorize = authorize
        self._observer = observer
        self._connections: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._closed = False
        identifier = {
            "Component": "istiod",
            "ID": control_plane_id,
            "Info": {
                "version": __version__,
                "revision": "",
                "golang_version": "",
                "status": "Clean",
                "tag": __version__,
            },
        }
        self._control_plane = base_pb2.ControlPlane(identifier=json.dumps(identifier))

    # -- public API -------------------------------------------------------------------------------

    @property
    def mesh(self) -> MeshConfig:
        return self._mesh

    def register(self, server: grpc.aio.Server) -> None:
        """Add the service to a gRPC server (usable as the control plane's ServerHook)."""
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, server)

    async def update_mesh(self, mesh: MeshConfig) -> None:
        """Make ``mesh`` current and queue a push to every stream; does not wait for any client."""
        if self._closed:
            return
        self._mesh = mesh
        for conn in list(self._connections.values()):
            conn.pending_mesh = mesh  # one slot: a push still pending is superseded
            conn.wake.set()

    def connections(self) -> list[ConnectionStatus]:
        """The open streams, oldest first (for tests and debugging)."""
        return [conn.status() for _, conn in sorted(self._connections.items())]

    async def close(self) -> None:
        """End every stream with OK and wait until their tasks are gone; new streams are refused."""
        self._closed = True
        conns = list(self._connections.values())
        tasks = [task for conn in conns for task in conn.tasks]
        for conn in conns:
            conn.done.set()  # each handler returns, which ends its stream with OK
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- RPC entry points ---------------------------------------------------------------------------

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._serve("sotw", request_iterator, context)

    async def DeltaAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self._serve("delta", request_iterator, context)

    # -- stream plumbing ------------------------------------------------------------------------------

    async def _serve(
        self, flavour: str, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        if self._closed:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "control plane is shutting down")
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if not (first.HasField("node") and first.node.id):
            log.warning("ADS: %s stream from %s without node information refused", flavour, context.peer())
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "missing node information")
        try:
            proxy = ProxyNode.from_node(first.node)
        except Exception as err:
            log.warning("ADS: %s stream from %s has an invalid node: %s", flavour, context.peer(), err)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"invalid node: {err}")
        if self._authorize is not None:
            await self._authorize(context, proxy)
        if self._closed:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "control plane is shutting down")

        conn = _Connection(next(self._ids), proxy, flavour)
        conn.requests.put_nowait(first)
        conn.tasks = [
            asyncio.create_task(self._read(conn, requests), name=f"ads-reader-{conn.id}"),
            asyncio.create_task(self._work(conn, context), name=f"ads-worker-{conn.id}"),
        ]
        conn.tasks[1].add_done_callback(lambda _: conn.done.set())
        self._connections[conn.id] = conn
        xds_connections.labels(flavour=flavour).inc()
        log.info("ADS: new %s connection id=%d node=%s", flavour, conn.id, proxy.id)
        try:
            await conn.done.wait()
        finally:
            # Bookkeeping before any await: gRPC may cancel this handler again while it cleans up.
            del self._connections[conn.id]
            xds_connections.labels(flavour=flavour).dec()
            log.info("ADS: %s connection closed id=%d node=%s", flavour, conn.id, proxy.id)
            for task in conn.tasks:
                task.cancel()
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        if conn.failure is not None:
            await _abort(context, conn.failure.code, conn.failure.details)

    async def _read(self, conn: _Connection, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                await conn.requests.put(request)
                conn.wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.debug("ADS: connection %d: read ended: %s", conn.id, err)
        finally:
            conn.reader_done = True
            conn.wake.set()

    async def _work(self, conn: _Connection, context: grpc.aio.ServicerContext) -> None:
        """The stream's only writer: requests first, then the pending push, until the client is done."""
        while True:
            conn.wake.clear()
            try:
                if not conn.requests.empty():
                    request = conn.requests.get_nowait()
                    if conn.delta:
                        responses = self._on_delta_request(conn, request)
                    else:
                        responses = self._on_sotw_request(conn, request)
                elif conn.pending_mesh is not None:
                    mesh, conn.pending_mesh = conn.pending_mesh, None
                    responses = self._on_push(conn, mesh)
                elif conn.reader_done:
                    return
                else:
                    await conn.wake.wait()
                    continue
            except _StreamFailure as failure:
                conn.failure = failure
                return
            except Exception:
                log.exception("ADS: connection %d (%s): internal error", conn.id, conn.proxy.id)
                conn.failure = _StreamFailure(grpc.StatusCode.INTERNAL, "internal error in the control plane")
                return
            for response in responses:
                try:
                    await context.write(response)
                except Exception as err:  # the stream is gone; the handler ends it
                    log.debug("ADS: connection %d: write failed: %s", conn.id, err)
                    return
                self._written(conn, response)

    def _written(self, conn: _Connection, response: Response) -> None:
        count = len(response.resources)
        xds_pushes.labels(type_url=response.type_url).inc()
        log.debug(
            "ADS: connection %d: sent %s with %d resources (nonce %s)",
            conn.id,
            response.type_url,
            count,
            response.nonce,
        )
        if self._observer is not None:
            try:
                self._observer.pushed(conn.id, response.type_url, response.nonce, count, time.monotonic())
            except Exception:
                log.exception("ADS: push observer failed")

    # -- snapshots ---------------------------------------------------------------------------------------

    def _compute(self, conn: _Connection, mesh: MeshConfig) -> _View:
        snapshot = self._snapshot_fn(mesh, conn.proxy)
        resources = {type_url: dict(snapshot.get(type_url) or {}) for type_url in PUSH_ORDER}
        versions = {
            type_url: {name: resource_version(message) for name, message in by_name.items()}
            for type_url, by_name in resources.items()
        }
        return _View(mesh, resources, versions)

    def _view(self, conn: _Connection) -> _View:
        """The connection's snapshot, computed from the current mesh on first use."""
        if conn.view is None:
            try:
                conn.view = self._compute(conn, self._mesh)
            except Exception as err:
                log.error("ADS: cannot generate configuration for %s: %s", conn.proxy.id, err)
                raise _StreamFailure(
                    grpc.StatusCode.INTERNAL, f"cannot generate configuration for {conn.proxy.id}: {err}"
                ) from err
        return conn.view

    def _on_push(self, conn: _Connection, mesh: MeshConfig) -> list[Response]:
        """Recompute the proxy's snapshot and build a response for each subscribed type that changed."""
        if conn.view is None or conn.view.mesh is mesh:
            return []  # nothing computed yet (it will use the newest mesh) or already current
        try:
            conn.view = self._compute(conn, mesh)
        except Exception as err:
            log.error(
                "ADS: cannot generate configuration for %s: %s; keeping what was pushed before",
                conn.proxy.id,
                err,
            )
            return []
        responses: list[Response] = []
        for type_url in PUSH_ORDER:
            state = conn.types.get(type_url)
            if state is None:
                continue
            response: Response | None
            if conn.delta:
                response = self._delta_response(conn, state, always=False)
            else:
                response = self._sotw_response(conn, state, only_if_changed=True)
            if response is not None:
                responses.append(response)
        return responses

    # -- requests common to both flavours -------------------------------------------------------------

    def _screen(self, conn: _Connection, type_url: str) -> bool:
        """Whether ``type_url`` is one of the five served types; unknown ones are logged and counted."""
        if type_url in PUSH_ORDER:
            return True
        if not type_url:
            log.debug("ADS: connection %d: request without type_url ignored", conn.id)
            return False
        xds_unknown_type.inc()
        if not conn.warned_unknown:
            conn.warned_unknown = True
            log.warning(
                "ADS: connection %d (%s): ignoring request for unknown type %.200r",
                conn.id,
                conn.proxy.id,
                type_url,
            )
        else:
            log.debug("ADS: connection %d: ignoring request for unknown type %.200r", conn.id, type_url)
        return False

    def _ack(self, conn: _Connection, state: _TypeState, nonce: str, error: str | None) -> None:
        """Record the client's answer to the last response of a type."""
        state.acked_nonce = nonce
        state.error = error
        if error is not None:
            conn.last_error = error
            xds_nacks.labels(type_url=state.type_url).inc()
            log.warning("ADS: %s rejected %s (nonce %s): %s", conn.proxy.id, state.type_url, nonce, error)
        if self._observer is not None:
            try:
                self._observer.acked(conn.id, state.type_url, nonce, time.monotonic(), error)
            except Exception:
                log.exception("ADS: push observer failed")

    # -- what SotW and Delta share ------------------------------------------------------------------------

    @staticmethod
    def _wants_syncz(request: Any) -> bool:
        """A syncz query (not the client acknowledging a syncz response)."""
        return (
            request.type_url == SYNCZ_TYPE
            and not request.response_nonce
            and not request.HasField("error_detail")
        )

    def _handled_alike(self, conn: _Connection, request: Any) -> bool:
        """Debug queries, unknown types and NACKs, the same in both flavours; True when nothing is left to do.

        The caller answers a syncz query (see :meth:`_wants_syncz`) in its own flavour.
        """
        type_url = request.type_url
        if type_url == SYNCZ_TYPE:
            return True
        if not self._screen(conn, type_url):
            return True
        if not request.HasField("error_detail"):
            return False
        state = conn.types.get(type_url)
        nonce = request.response_nonce
        if state is not None and state.sent_nonce and nonce == state.sent_nonce:
            self._ack(conn, state, nonce, _error_text(request))
        else:
            log.debug("ADS: connection %d: NACK of %s for an unknown nonce ignored", conn.id, type_url)
        return True

    # -- state of the world -----------------------------------------------------------------------------

    def _on_sotw_request(
        self, conn: _Connection, request: discovery_pb2.DiscoveryRequest
    ) -> list[discovery_pb2.DiscoveryResponse]:
        if self._handled_alike(conn, request):
            return [self._syncz_response(conn)] if self._wants_syncz(request) else []
        type_url = request.type_url
        state = conn.types.get(type_url)
        nonce = request.response_nonce
        wildcard = type_url in WILDCARD_TYPES
        names = set(request.resource_names)
        if state is not None and nonce:
            if nonce != state.sent_nonce:
                log.debug("ADS: connection %d: stale nonce %s for %s ignored", conn.id, nonce, type_url)
                return []
            self._ack(conn, state, nonce, None)
            if wildcard or names == state.names:
                return []
        # A subscription: a first request for the type (even with a nonce, as after a control plane
        # restart), a request without nonce, or an ACK that changes the names asked for.
        if not wildcard and not names:
            if state is not None:
                log.debug("ADS: connection %d: unsubscribed from %s", conn.id, type_url)
                del conn.types[type_url]
            return []
        if state is None:
            state = conn.types[type_url] = _TypeState(type_url, wildcard=wildcard)
        state.names = set() if wildcard else names
        response = self._sotw_response(conn, state, only_if_changed=False)
        return [response] if response is not None else []

    def _sotw_response(
        self, conn: _Connection, state: _TypeState, *, only_if_changed: bool
    ) -> discovery_pb2.DiscoveryResponse | None:
        view = self._view(conn)
        resources = view.resources[state.type_url]
        versions = view.versions[state.type_url]
        names = sorted(resources) if state.wildcard else sorted(n for n in state.names if n in resources)
        version = _content_version((name, versions[name]) for name in names)
        if only_if_changed and state.sent_nonce and version == state.version:
            return None
        response = discovery_pb2.DiscoveryResponse(
            version_info=version,
            resources=[_pack(resources[name]) for name in names],
            type_url=state.type_url,
            nonce=_nonce(),
            control_plane=self._control_plane,
        )
        state.sent(response.nonce, version, len(names))
        return response

    # -- delta -------------------------------------------------------------------------------------------

    def _on_delta_request(
        self, conn: _Connection, request: discovery_pb2.DeltaDiscoveryRequest
    ) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        if self._handled_alike(conn, request):
            return [self._syncz_delta_response(conn)] if self._wants_syncz(request) else []
        type_url = request.type_url
        state = conn.types.get(type_url)
        nonce = request.response_nonce
        if state is not None and nonce:
            if nonce == state.sent_nonce:
                self._ack(conn, state, nonce, None)
            else:
                log.debug("ADS: connection %d: stale nonce %s for %s ignored", conn.id, nonce, type_url)
        subscribe = _unique(request.resource_names_subscribe)
        wildcard_type = type_url in WILDCARD_TYPES
        first = state is None
        if state is None:
            state = conn.types[type_url] = _TypeState(type_url)
            state.wildcard = wildcard_type and (not subscribe or "*" in subscribe)
            # Resources the client kept from an earlier stream: not resent unless they changed.
            state.client_versions = dict(request.initial_resource_versions)
        for name in subscribe:
            if name != "*":
                state.names.add(name)
            elif wildcard_type:
                state.wildcard = True
        for name in request.resource_names_unsubscribe:
            if name == "*":
                state.wildcard = False
            else:
                state.names.discard(name)
        for name in [n for n in state.client_versions if not (state.wildcard or n in state.names)]:
            del state.client_versions[name]  # no longer wanted: the client drops it itself
        response = self._delta_response(conn, state, always=first)
        return [response] if response is not None else []

    def _delta_response(
        self, conn: _Connection, state: _TypeState, *, always: bool
    ) -> discovery_pb2.DeltaDiscoveryResponse | None:
        """The diff between the snapshot and what the client holds; None when there is none.

        ``always``: answer even an empty diff (the first request of a type, which the client
        waits on to finish initializing).
        """
        view = self._view(conn)
        resources = view.resources[state.type_url]
        versions = view.versions[state.type_url]
        wanted = sorted(resources) if state.wildcard else sorted(n for n in state.names if n in resources)
        changed = [name for name in wanted if state.client_versions.get(name) != versions[name]]
        removed = sorted(name for name in state.client_versions if name not in resources)
        if not (changed or removed or always):
            return None
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=_content_version((name, versions[name]) for name in wanted),
            resources=[
                discovery_pb2.Resource(name=name, version=versions[name], resource=_pack(resources[name]))
                for name in changed
            ],
            type_url=state.type_url,
            removed_resources=removed,
            nonce=_nonce(),
            control_plane=self._control_plane,
        )
        for name in changed:
            state.client_versions[name] = versions[name]
        for name in removed:
            del state.client_versions[name]
        state.sent(response.nonce, response.system_version_info, len(state.client_versions))
        return response

    # -- syncz -------------------------------------------------------------------------------------------

    def _client_configs(self) -> list[csds_pb2.ClientConfig]:
        """One ClientConfig per stream subscribed to at least one served type, by node id."""
        configs = []
        for conn in sorted(self._connections.values(), key=lambda c: (c.proxy.id, c.id)):
            if conn.types:
                configs.append(self._client_config(conn))
        return configs

    def _client_config(self, conn: _Connection) -> csds_pb2.ClientConfig:
        config = csds_pb2.ClientConfig()
        config.node.id = conn.proxy.id
        for key in SYNCZ_METADATA:
            value = conn.proxy.metadata.get(key)
            if isinstance(value, str):
                config.node.metadata[key] = value
        for type_url, state in sorted(conn.types.items()):
            status = state.status()
            entry = config.generic_xds_configs.add(
                type_url=type_url,
                version_info=status.version,
                config_status=csds_pb2.ConfigStatus.Value(status.config_status),
            )
            if status.last_sent is not None:
                entry.last_updated.CopyFrom(_timestamp(status.last_sent))
            if status.error is not None:
                entry.error_state.details = status.error
                if status.last_sent is not None:
                    entry.error_state.last_update_attempt.CopyFrom(_timestamp(status.last_sent))
        return config

    def _syncz_response(self, conn: _Connection) -> discovery_pb2.DiscoveryResponse:
        log.debug("ADS: connection %d: syncz requested", conn.id)
        return discovery_pb2.DiscoveryResponse(
            type_url=SYNCZ_TYPE,
            resources=[_pack(config) for config in self._client_configs()],
            nonce=_nonce(),
            control_plane=self._control_plane,
        )

    def _syncz_delta_response(self, conn: _Connection) -> discovery_pb2.DeltaDiscoveryResponse:
        log.debug("ADS: connection %d: syncz requested", conn.id)
        return discovery_pb2.DeltaDiscoveryResponse(
            type_url=SYNCZ_TYPE,
            resources=[
                discovery_pb2.Resource(name=config.node.id, resource=_pack(config))
                for config in self._client_configs()
            ],
            nonce=_nonce(),
            control_plane=self._control_plane,
        )
