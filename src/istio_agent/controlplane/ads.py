"""The local control plane's Aggregated Discovery Service: SotW and Delta ADS, plus istiod's debug types.

The protocol rules are istiod's (``pilot/pkg/xds/ads.go``, ``pilot/pkg/xds/delta.go``; see
docs/controlplane.md), because Envoy's ACK, NACK and reconnect behaviour is tuned against them. A
NACK is recorded and never answered, so a rejected config cannot turn into a NACK loop. A stale
nonce is ignored.

The streams run on the project's xDS stream core (:mod:`istio_agent.xds.stream`), which owns the
reader, the worker and the SotW/Delta bookkeeping. This module supplies what is the control
plane's own: each proxy's snapshot of the mesh, computed once per mesh and per stream; content
hashes as versions; wildcard types; the push order; the debug types (syncz, config_dump:
:mod:`istio_agent.controlplane.debug`); the authorizer; metrics and logs.
Proxyless gRPC nodes (``GENERATOR=grpc``) get other rules, as from istiod's grpc generator: no
wildcard types, and resources generated for the names they ask for (:mod:`.grpcgen`).
:meth:`AdsServer.update_mesh` only fills each stream's one pending-push slot (the newest mesh
wins) and returns, so a client that stops reading stalls its own worker and nobody else's, and
holds at most one pending mesh.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from envoy.config.core.v3 import base_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from istio_agent import __version__
from istio_agent.controlplane import debug
from istio_agent.controlplane.debug import SYNCZ_TYPE
from istio_agent.controlplane.grpcgen import build_grpc_resources, is_grpc_node
from istio_agent.controlplane.mesh import MeshConfig
from istio_agent.controlplane.nodeid import node_id_error
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    EXTENSION_CONFIG_TYPE,
    LISTENER_TYPE,
    NAME_TABLE_TYPE,
    ROUTE_TYPE,
    ProxyNode,
    Snapshot,
)
from istio_agent.log import scope
from istio_agent.metrics import Registry
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call, ServerCall
from istio_agent.rpc.server import RpcServer
from istio_agent.xds.flavour import (
    ADS_SERVICE,
    DELTA,
    SOTW,
    Flavour,
    Request,
    Resource,
    Resources,
    Response,
    resource_version,
)
from istio_agent.xds.stream import Change, Reply, Source, Stream, StreamError, StreamServer, require_node
from istio_agent.xds.watch import Policy, TypeStatus, Watch

__all__ = [
    "SYNCZ_TYPE",
    "AdsServer",
    "Authorizer",
    "ConnectionStatus",
    "PushObserver",
    "SnapshotFn",
    "TypeStatus",
]

log = scope("ads")

PUSH_ORDER = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, NAME_TABLE_TYPE, EXTENSION_CONFIG_TYPE)
"""The served types, in the order pushes go out: make before break (clusters before their users).
ECDS (WasmPlugins) is last, as istiod pushes the types its PushOrder does not list after those it does;
like RDS it serves the names asked for (the listeners' ``config_discovery`` filters)."""
WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE, NAME_TABLE_TYPE})
"""Types a client gets in full; EDS and RDS serve only the names asked for."""

GRPC_POLICY = Policy(wildcard_types=frozenset(), answer_first_delta=True)
"""Proxyless gRPC subscribes to every type by name (istiod's grpc generator answers those names)."""

SnapshotFn = Callable[[MeshConfig, ProxyNode], Snapshot]
"""A proxy's configuration from the mesh; raises ValueError when the mesh has none for it."""
NamedFn = Callable[[MeshConfig, ProxyNode, str, Sequence[str]], dict[str, Message]]
"""A proxyless node's resources of a type among the names it asked for."""
Authorizer = Callable[[Call, ProxyNode], Awaitable[str | None]]
"""Awaited once per stream with the proxy's node: the caller's verified SPIFFE identity; refuses by
aborting the call. Not asked on a server added with ``authorize=False`` (a plaintext port)."""

_AUTHORIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("ads_authorizing", default=True)
"""Whether the server this stream came in on asks the authorizer (set by each server's handler:
the stream core hands ``open`` only the request and the call)."""


class _AdsMetrics:
    """The local control plane's ADS metrics."""

    def __init__(self, registry: Registry) -> None:
        self.connections = registry.gauge(
            "controlplane_xds_connections", "Open ADS streams on the local control plane.", ["flavour"]
        )
        self.pushes = registry.counter(
            "controlplane_xds_pushes",
            "Discovery responses the local control plane sent, by type.",
            ["type_url"],
        )
        self.nacks = registry.counter(
            "controlplane_xds_nacks", "Discovery responses clients rejected (NACK), by type.", ["type_url"]
        )
        self.unknown_type = registry.counter(
            "controlplane_xds_unknown_type",
            "Discovery requests for a type the local control plane does not serve.",
        )


class PushObserver(Protocol):
    """Optional hooks to time pushes (the benchmark); ``at`` is ``time.monotonic()``."""

    def pushed(self, conn_id: int, type_url: str, nonce: str, resources: int, at: float) -> None:
        """A response was written to the stream (``resources``: how many it carried)."""

    def acked(self, conn_id: int, type_url: str, nonce: str, at: float, error: str | None) -> None:
        """The client answered the last response of a type: ACK (``error`` None) or NACK."""


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


@dataclass
class _View:
    """A proxy's snapshot and every resource's version, by type, computed once per mesh."""

    mesh: MeshConfig
    messages: dict[str, dict[str, Message]]
    versions: dict[str, dict[str, str]]
    asked: dict[str, set[str]] | None = None
    """Proxyless nodes only: the names generated so far, by type (resources are built per name)."""


@dataclass
class _Proxy:
    """What the control plane keeps per stream."""

    node: ProxyNode
    view: _View | None = None
    warned_unknown: bool = False
    grpc: bool = False
    """A proxyless gRPC node: answered by name (``NamedFn``) instead of from a snapshot."""
    debug_only: bool = False
    """The stream began with a debug question (istioctl, agentctl): not a proxy."""
    identity: str | None = None
    """The caller's verified identity (what the authorizer proved), which debug questions need."""


_AdsStream = Stream[_Proxy, MeshConfig]


def _content_version(pairs: Iterable[tuple[str, str]]) -> str:
    """A stable version of a set of resources: hash over their sorted (name, version) pairs."""
    digest = hashlib.sha256()
    for name, version in sorted(pairs):
        digest.update(f"{name}\0{version}\n".encode())
    return digest.hexdigest()[:16]


def _keep_extension_configs(previous: _View, current: _View) -> None:
    """istiod's ``neverRemoveDelta`` (``pilot/pkg/xds/delta.go``, envoyproxy/envoy#32823): over Delta an
    ECDS resource gone from the mesh is kept as last sent, never removed; Envoy unsubscribes from it
    once no listener refers to it."""
    kept = current.messages[EXTENSION_CONFIG_TYPE]
    for name, message in previous.messages[EXTENSION_CONFIG_TYPE].items():
        if name not in kept:
            kept[name] = message
            current.versions[EXTENSION_CONFIG_TYPE][name] = previous.versions[EXTENSION_CONFIG_TYPE][name]


class _Snapshots(Source[_Proxy, MeshConfig]):
    """The control plane's answers to the stream core: each proxy's view of the current mesh."""

    policy = Policy(wildcard_types=WILDCARD_TYPES, answer_first_delta=True)

    def __init__(
        self,
        mesh: MeshConfig,
        snapshot_fn: SnapshotFn,
        authorize: Authorizer | None,
        observer: PushObserver | None,
        control_plane: base_pb2.ControlPlane,
        metrics: _AdsMetrics,
        named_fn: NamedFn,
    ) -> None:
        self._metrics = metrics
        self._named_fn = named_fn
        self.mesh = mesh
        self.streams: Callable[[], list[_AdsStream]] = list
        """The open streams (for syncz); set by the server."""
        self._snapshot_fn = snapshot_fn
        self._authorize = authorize
        self._observer = observer
        self.control_plane = control_plane
        self.debug_access = debug.DebugAccess()

    # -- streams ---------------------------------------------------------------------------------

    async def open(self, request: Request, call: Call, flavour: Flavour) -> _Proxy:
        require_node(request)
        try:
            node = ProxyNode.from_node(request.node)
        except (ValueError, json_format.Error) as err:
            raise StreamError(Status.INVALID_ARGUMENT, f"invalid node: {err}") from err
        refusal = node_id_error(node.id, node.metadata)
        if refusal is not None:
            raise StreamError(Status.INVALID_ARGUMENT, refusal)
        identity = (
            await self._authorize(call, node) if self._authorize is not None and _AUTHORIZING.get() else None
        )
        if identity is not None:
            # istiod's VerifiedIdentity: WasmPlugins' pull secrets go only to such proxies.
            node = dataclasses.replace(node, verified=True)
        return _Proxy(
            node,
            grpc=is_grpc_node(node),
            debug_only=debug.is_debug_type(request.type_url),
            identity=identity,
        )

    def stream_policy(self, stream: _AdsStream) -> Policy:
        return GRPC_POLICY if stream.data.grpc else self.policy

    def opened(self, stream: _AdsStream, request: Request) -> None:
        self._metrics.connections.labels(flavour=stream.flavour.label).inc()
        log.info("ADS: new %s connection id=%d node=%s", stream.flavour.label, stream.id, stream.data.node.id)

    def closed(self, stream: _AdsStream) -> None:
        self._metrics.connections.labels(flavour=stream.flavour.label).dec()
        log.info(
            "ADS: %s connection closed id=%d node=%s", stream.flavour.label, stream.id, stream.data.node.id
        )

    # -- what is served --------------------------------------------------------------------------

    def watched_type(self, stream: _AdsStream, type_url: str) -> str | None:
        """``type_url`` when it is one of the served types; unknown ones are logged and counted."""
        if type_url in PUSH_ORDER:
            return type_url
        if not type_url:
            log.debug("ADS: connection %d: request without type_url ignored", stream.id)
            return None
        self._metrics.unknown_type.inc()
        if not stream.data.warned_unknown:
            stream.data.warned_unknown = True
            log.warning(
                "ADS: connection %d (%s): ignoring request for unknown type %.200r",
                stream.id,
                stream.data.node.id,
                type_url,
            )
        else:
            log.debug("ADS: connection %d: ignoring request for unknown type %.200r", stream.id, type_url)
        return None

    async def resources(self, stream: _AdsStream, type_url: str, names: Sequence[str] | None) -> Resources:
        view = self._view(stream.data)
        if view.asked is not None and names is not None:
            self._generate(stream.data.node, view, type_url, names)
        messages = view.messages[type_url]
        chosen = sorted(messages) if names is None else sorted(name for name in names if name in messages)
        return Resources(chosen, messages, view.versions[type_url])

    def version(self, type_url: str, versions: Iterable[tuple[str, str]]) -> str:
        return _content_version(versions)

    def changes(self, stream: _AdsStream, event: MeshConfig) -> Iterable[Change]:
        """Recompute the proxy's snapshot; every served type may have changed, in push order."""
        proxy = stream.data
        if proxy.view is None or proxy.view.mesh is event:
            return ()  # nothing computed yet (it will use the newest mesh) or already current
        previous = proxy.view
        try:
            proxy.view = self._compute(proxy, event)
        except ValueError as err:
            log.error(
                "ADS: cannot generate configuration for %s: %s; keeping what was pushed before",
                proxy.node.id,
                err,
            )
            return ()
        if stream.flavour is DELTA:
            _keep_extension_configs(previous, proxy.view)
        return [(type_url, None) for type_url in PUSH_ORDER]

    def _compute(self, proxy: _Proxy, mesh: MeshConfig) -> _View:
        if proxy.grpc:  # filled name by name as the node asks (_generate)
            messages: dict[str, dict[str, Message]] = {type_url: {} for type_url in PUSH_ORDER}
            versions: dict[str, dict[str, str]] = {type_url: {} for type_url in PUSH_ORDER}
            return _View(mesh, messages, versions, {type_url: set() for type_url in PUSH_ORDER})
        snapshot = self._snapshot_fn(mesh, proxy.node)
        messages = {type_url: dict(snapshot.get(type_url) or {}) for type_url in PUSH_ORDER}
        versions = {
            type_url: {name: resource_version(message) for name, message in by_name.items()}
            for type_url, by_name in messages.items()
        }
        return _View(mesh, messages, versions)

    def _generate(self, node: ProxyNode, view: _View, type_url: str, names: Sequence[str]) -> None:
        """Add the resources of ``names`` not generated yet for this mesh to a proxyless node's view."""
        assert view.asked is not None
        asked = view.asked[type_url]
        missing = [name for name in names if name not in asked]
        if not missing:
            return
        generated = self._named_fn(view.mesh, node, type_url, missing)
        for name, message in generated.items():
            view.messages[type_url][name] = message
            view.versions[type_url][name] = resource_version(message)
        asked.update(missing)
        unknown = [name for name in missing if name not in generated]
        if unknown:  # once per name and mesh: a mistyped xds:/// target is visible in the log
            log.warning(
                "ADS: %s asked for %s the mesh file has nothing for: %.300s",
                node.id,
                type_url.rpartition(".")[2],
                ", ".join(unknown),
            )

    def _view(self, proxy: _Proxy) -> _View:
        """The proxy's snapshot, computed from the current mesh on first use."""
        if proxy.view is None:
            try:
                proxy.view = self._compute(proxy, self.mesh)
            except ValueError as err:
                raise StreamError(
                    Status.INTERNAL, f"cannot generate configuration for {proxy.node.id}: {err}"
                ) from err
        return proxy.view

    # -- what happened ---------------------------------------------------------------------------

    def sent(self, stream: _AdsStream, response: Response, names: list[str], cause: str) -> None:
        count = len(response.resources)
        self._metrics.pushes.labels(type_url=response.type_url).inc()
        log.debug(
            "ADS: connection %d: sent %s with %d resources (nonce %s)",
            stream.id,
            response.type_url,
            count,
            response.nonce,
        )
        if self._observer is not None:
            self._observer.pushed(stream.id, response.type_url, response.nonce, count, time.monotonic())

    def acked(self, stream: _AdsStream, watch: Watch) -> None:
        if self._observer is not None:
            self._observer.acked(stream.id, watch.type_url, watch.acked_nonce, time.monotonic(), None)

    def nacked(self, stream: _AdsStream, request: Request, watch: Watch | None) -> None:
        if watch is None:
            log.debug(
                "ADS: connection %d: NACK of %s for an unknown nonce ignored", stream.id, request.type_url
            )
            return
        self._metrics.nacks.labels(type_url=watch.type_url).inc()
        log.warning(
            "ADS: %s rejected %s (nonce %s): %s",
            stream.data.node.id,
            watch.type_url,
            watch.acked_nonce,
            watch.error,
        )
        if self._observer is not None:
            self._observer.acked(stream.id, watch.type_url, watch.acked_nonce, time.monotonic(), watch.error)

    # -- istio.io/debug/* -------------------------------------------------------------------------

    def is_query(self, type_url: str) -> bool:
        return debug.is_debug_type(type_url)

    async def answer(self, stream: _AdsStream, request: Request) -> Reply | None:
        """syncz and config_dump (see :mod:`istio_agent.controlplane.debug`); other debug types fail
        a debug client's stream and are ignored on a proxy's (as istiod does)."""
        type_url = request.type_url
        log.debug("ADS: connection %d: %s requested", stream.id, type_url)
        if type_url in debug.SERVED:
            if self.debug_access.refuses(stream.data.identity):
                log.warning(
                    "proxy %s is not authorized to receive debug info. Ensure you are connecting over TLS "
                    "port and are authenticated.",
                    debug.proxy_id(stream.data.node),
                )
                raise StreamError(Status.UNAUTHENTICATED, debug.AUTHENTICATION_REQUIRED)
            namespace = self.debug_access.namespace_filter(stream.data.identity)
            if type_url == debug.SYNCZ_TYPE:
                proxies = ((other.data.node, other.watches) for other in self.streams())
                return Reply(debug.syncz(proxies, namespace))
            return Reply(self._config_dump(stream.flavour.requested_names(request), namespace))
        if stream.data.debug_only:
            raise StreamError(Status.INVALID_ARGUMENT, debug.unknown_type(type_url))
        log.warning("ADS: connection %d: %s; not answered", stream.id, debug.unknown_type(type_url))
        return None

    def _config_dump(self, names: Sequence[str], namespace: str) -> list[Resource]:
        """istiod's rule: exactly one proxy ID; an unknown one, or one outside ``namespace`` (when
        given: the caller may see only its own), gets a response with no resources."""
        if len(names) != 1:
            log.info("ADS: %s with %d resource names", debug.CONFIG_DUMP_TYPE, len(names))
            return []
        for other in self.streams():
            if namespace and other.data.node.namespace != namespace:
                continue
            if debug.proxy_id(other.data.node) == names[0] and other.data.view is not None:
                view = other.data.view
                return debug.config_dump(view.messages, view.versions)
        log.info("ADS: %s: no connection for proxy %.200r", debug.CONFIG_DUMP_TYPE, names[0])
        return []


class AdsServer:
    """ADS for every proxy, from ``snapshot_fn(mesh, proxy)``; :meth:`update_mesh` pushes changes."""

    def __init__(
        self,
        mesh: MeshConfig,
        snapshot_fn: SnapshotFn,
        *,
        authorize: Authorizer | None = None,
        control_plane_id: str = "agentctl-controlplane",
        observer: PushObserver | None = None,
        registry: Registry,
        named_fn: NamedFn = build_grpc_resources,
        debug_access: debug.DebugAccess | None = None,
    ) -> None:
        """``debug_access``: who may ask syncz and config_dump (default: istiod's default rules)."""
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
        control_plane = base_pb2.ControlPlane(identifier=json.dumps(identifier))
        self._source = _Snapshots(
            mesh, snapshot_fn, authorize, observer, control_plane, _AdsMetrics(registry), named_fn
        )
        self._streams: StreamServer[_Proxy, MeshConfig] = StreamServer(
            self._source, name="ads", log=log, describe="control plane"
        )
        self._source.streams = self._streams.streams
        if debug_access is not None:
            self._source.debug_access = debug_access

    # -- public API -------------------------------------------------------------------------------

    @property
    def mesh(self) -> MeshConfig:
        return self._source.mesh

    def add_to(self, server: RpcServer, *, authorize: bool = True) -> None:
        """Serve ADS (SotW and Delta) on ``server``; ``authorize=False`` for a port that, like
        istiod's plaintext 15010, asks no identity (its streams' identity is None)."""
        for flavour in (SOTW, DELTA):
            server.add_stream(
                f"/{ADS_SERVICE}/{flavour.method}",
                self._handler(flavour, authorize),
                flavour.request_type,
                flavour.response_type,
            )

    def _handler(self, flavour: Flavour, authorize: bool) -> Callable[[ServerCall], Awaitable[None]]:
        async def serve(call: ServerCall) -> None:
            _AUTHORIZING.set(authorize)  # this call's task has a context of its own
            await self._streams.serve(flavour, call)

        return serve

    async def update_mesh(self, mesh: MeshConfig) -> None:
        """Make ``mesh`` current and queue a push to every stream; does not wait for any client."""
        if self._streams.closing:
            return
        self._source.mesh = mesh
        for stream in self._streams.streams():
            stream.push(mesh)  # one slot: a push still pending is superseded

    def connections(self) -> list[ConnectionStatus]:
        """The open streams, oldest first (for tests and debugging)."""
        return [
            ConnectionStatus(
                conn_id=stream.id,
                node_id=stream.data.node.id,
                flavour=stream.flavour.label,
                types={url: watch.status() for url, watch in sorted(stream.watches.items())},
                last_error=stream.last_error,
            )
            for stream in self._streams.streams()
        ]

    async def close(self) -> None:
        """End every stream with OK and wait until their tasks are gone; new streams are refused."""
        await self._streams.close()
