"""The local control plane's ADS server over real gRPC on loopback, driven by real grpc.aio streams.

Silence is asserted with a barrier instead of a timeout: each stream's requests are handled in
order, so after an ACK (or a push that has been computed) a syncz request must be answered by
the very next message. Anything sent in between would arrive before the syncz response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import pytest
from envoy.admin.v3.config_dump_shared_pb2 import ClustersConfigDump
from envoy.config.cluster.v3.cluster_pb2 import Cluster
from envoy.config.core.v3.base_pb2 import Node
from envoy.config.endpoint.v3.endpoint_components_pb2 import LocalityLbEndpoints
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.config.listener.v3.listener_pb2 import Listener
from envoy.config.route.v3.route_pb2 import RouteConfiguration
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf.message import Message
from google.rpc import status_pb2

from istio_agent.controlplane.ads import SYNCZ_TYPE, AdsServer, Authorizer, TypeStatus
from istio_agent.controlplane.debug import CONFIG_DUMP_TYPE, DebugAccess
from istio_agent.controlplane.mesh import MeshConfig
from istio_agent.controlplane.xdsgen import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NAME_TABLE_TYPE,
    ROUTE_TYPE,
    ProxyNode,
    Snapshot,
)
from istio_agent.metrics import PREFIX, Registry
from istio_agent.protos import nds_pb2
from istio_agent.rpc import Status
from istio_agent.rpc.call import Call
from istio_agent.rpc.server import RpcServer
from istio_agent.xds.flavour import resource_version

M = TypeVar("M", bound=Message)
RESPONSE_WAIT = 5.0
"""Upper bound for an expected message; only hit when a test is failing."""
UNKNOWN_TYPE = "type.googleapis.com/example.Unknown"

SLEEP_NODE = Node(id="sidecar~10.0.0.1~sleep-1.default~default.svc.cluster.local")
SLEEP_NODE.metadata["CLUSTER_ID"] = "Kubernetes"
SLEEP_NODE.metadata["NAMESPACE"] = "default"
SLEEP_NODE.metadata["ISTIO_VERSION"] = "1.31.0"
SLEEP_NODE.metadata["SERVICE_ACCOUNT"] = "sleep"
SLEEP_NODE.metadata["PROXY_CONFIG"] = {"discoveryAddress": "istiod.istio-system.svc:15012"}
OTHER_NODE = Node(id="sidecar~10.0.0.2~httpbin-1.apps~apps.svc.cluster.local")
OTHER_NODE.metadata["PROXY_CONFIG"] = {}
ISTIOCTL_NODE = Node(id="sidecar~10.0.0.99~test-1.default~default.svc.cluster.local")
"""What istioctl's client (``pkg/adsc``) sends: a sidecar node type, metadata without PROXY_CONFIG."""
ISTIOCTL_NODE.metadata["GENERATOR"] = "event"
ISTIOCTL_NODE.metadata["NAMESPACE"] = "istio-system"


def mesh(
    clusters: dict[str, Any] | None = None,
    endpoints: dict[str, int] | None = None,
    listeners: dict[str, int] | None = None,
    routes: dict[str, int] | None = None,
    names: dict[str, str] | None = None,
) -> MeshConfig:
    """A mesh whose raw document the test snapshot function turns into resources, one value each."""
    return MeshConfig(
        raw={
            "clusters": {"a": 1, "b": 1} if clusters is None else clusters,
            "endpoints": {"a": 1, "b": 1} if endpoints is None else endpoints,
            "listeners": {"l1": 1} if listeners is None else listeners,
            "routes": {"r1": 1, "r2": 1} if routes is None else routes,
            "names": {"a.default.svc.cluster.local": "10.0.0.1"} if names is None else names,
        }
    )


def build(config: MeshConfig, proxy: ProxyNode) -> Snapshot:
    raw = config.raw
    table = nds_pb2.NameTable()
    for host, ip in raw["names"].items():
        table.table[host].ips.append(ip)
    return {
        CLUSTER_TYPE: {n: Cluster(name=n, alt_stat_name=str(v)) for n, v in raw["clusters"].items()},
        ENDPOINT_TYPE: {
            n: ClusterLoadAssignment(cluster_name=n, endpoints=[LocalityLbEndpoints(priority=v)])
            for n, v in raw["endpoints"].items()
        },
        LISTENER_TYPE: {n: Listener(name=n, stat_prefix=str(v)) for n, v in raw["listeners"].items()},
        ROUTE_TYPE: {
            n: RouteConfiguration(name=n, internal_only_headers=[str(v)]) for n, v in raw["routes"].items()
        },
        NAME_TABLE_TYPE: {"": table},
    }


def unpack(resource: Any, message: M) -> M:
    assert resource.Unpack(message), f"resource is a {resource.type_url}"
    return message


def clusters_of(response: discovery_pb2.DiscoveryResponse) -> dict[str, str]:
    """name -> alt_stat_name (the test's content marker) of a SotW CDS response."""
    assert response.type_url == CLUSTER_TYPE
    found = [unpack(r, Cluster()) for r in response.resources]
    return {c.name: c.alt_stat_name for c in found}


def names_of(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    result = []
    for resource in response.resources:
        assert resource.type_url == response.type_url
        message: Message = {
            CLUSTER_TYPE: Cluster(),
            ENDPOINT_TYPE: ClusterLoadAssignment(),
            LISTENER_TYPE: Listener(),
            ROUTE_TYPE: RouteConfiguration(),
        }[response.type_url]
        unpack(resource, message)
        name = getattr(message, "cluster_name", None) or message.name
        result.append(name)
    return result


def error(message: str) -> status_pb2.Status:
    return status_pb2.Status(code=13, message=message)


@dataclass
class Observer:
    pushes: list[tuple[int, str, str, int]] = field(default_factory=list)
    acks: list[tuple[int, str, str, str | None]] = field(default_factory=list)

    def pushed(self, conn_id: int, type_url: str, nonce: str, resources: int, at: float) -> None:
        assert at > 0
        self.pushes.append((conn_id, type_url, nonce, resources))

    def acked(self, conn_id: int, type_url: str, nonce: str, at: float, error: str | None) -> None:
        self.acks.append((conn_id, type_url, nonce, error))


class Client:
    """One ADS stream; the first request carries the node. Responses are collected in a queue."""

    def __init__(self, call: Any, node: Node | None, *, delta: bool, collect: bool = True) -> None:
        self.call = call
        self.node = node
        self.delta = delta
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        self._pump = asyncio.create_task(self._collect()) if collect else None

    async def _collect(self) -> None:
        try:
            while True:
                message = await self.call.read()
                self.received.put_nowait(message)
                if message is grpc.aio.EOF:
                    return
        except grpc.aio.AioRpcError as err:
            self.received.put_nowait(err)

    async def send(self, request: Any) -> None:
        if self.node is not None:
            request.node.CopyFrom(self.node)
            self.node = None
        await self.call.write(request)

    async def request(
        self,
        type_url: str,
        names: Sequence[str] = (),
        nonce: str = "",
        error_message: str | None = None,
        version: str = "",
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url, resource_names=names, response_nonce=nonce, version_info=version
        )
        if error_message is not None:
            request.error_detail.CopyFrom(error(error_message))
        await self.send(request)

    async def delta_request(
        self,
        type_url: str,
        subscribe: Sequence[str] = (),
        unsubscribe: Sequence[str] = (),
        initial: dict[str, str] | None = None,
        nonce: str = "",
        error_message: str | None = None,
    ) -> None:
        request = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url,
            resource_names_subscribe=subscribe,
            resource_names_unsubscribe=unsubscribe,
            initial_resource_versions=initial or {},
            response_nonce=nonce,
        )
        if error_message is not None:
            request.error_detail.CopyFrom(error(error_message))
        await self.send(request)

    async def ack(self, response: Any, names: Sequence[str] = ()) -> None:
        if self.delta:
            await self.delta_request(response.type_url, nonce=response.nonce)
        else:
            await self.request(response.type_url, names, response.nonce, version=response.version_info)

    async def response(self, type_url: str | None = None) -> Any:
        message = await asyncio.wait_for(self.received.get(), RESPONSE_WAIT)
        if isinstance(message, grpc.aio.AioRpcError):
            raise AssertionError(f"stream failed: {message.code()} {message.details()}")
        assert message is not grpc.aio.EOF, "stream ended"
        if type_url is not None:
            assert message.type_url == type_url, f"expected {type_url}, got {message.type_url}"
        return message

    async def subscribe(self, type_url: str, names: Sequence[str] = ()) -> Any:
        """Subscribe and ACK the response; returns the response."""
        if self.delta:
            await self.delta_request(type_url, names)
        else:
            await self.request(type_url, names)
        response = await self.response(type_url)
        await self.ack(response, names)
        return response

    async def barrier(self) -> list[csds_pb2.ClientConfig]:
        """Ask syncz; the next message must be its answer (nothing else was sent before it)."""
        if self.delta:
            await self.delta_request(SYNCZ_TYPE)
            response = await self.response(SYNCZ_TYPE)
            return [unpack(r.resource, csds_pb2.ClientConfig()) for r in response.resources]
        await self.request(SYNCZ_TYPE)
        response = await self.response(SYNCZ_TYPE)
        return [unpack(r, csds_pb2.ClientConfig()) for r in response.resources]

    async def end(self) -> Any:
        """The stream's end: EOF (OK) or the AioRpcError."""
        message = await asyncio.wait_for(self.received.get(), RESPONSE_WAIT)
        assert message is grpc.aio.EOF or isinstance(message, grpc.aio.AioRpcError), message
        return message

    async def close(self) -> None:
        self.call.cancel()
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)


class Harness:
    """An AdsServer on the agent's gRPC server on 127.0.0.1, the snapshot calls it made, and grpcio
    clients (as real proxies and apps connect)."""

    def __init__(
        self, config: MeshConfig, authorize: Authorizer | None = None, debug_access: DebugAccess | None = None
    ) -> None:
        """No ``debug_access``: debug questions need no identity (these clients prove none)."""
        self.calls: list[tuple[MeshConfig, str]] = []
        self.failing: set[str] = set()
        self.observer = Observer()
        self.registry = Registry()  # the server's own: tests read absolute values
        self.ads = AdsServer(
            config,
            self.snapshot,
            authorize=authorize,
            control_plane_id="cp-test",
            observer=self.observer,
            registry=self.registry,
            debug_access=debug_access or DebugAccess(enabled=False),
        )
        self.server = RpcServer()
        self.ads.add_to(self.server)
        self.clients: list[Client] = []

    async def start(self) -> None:
        await self.server.start(host="127.0.0.1", port=0)
        port = self.server.sockets()[0].getsockname()[1]
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.sample(PREFIX + name, labels) or 0.0

    def snapshot(self, config: MeshConfig, proxy: ProxyNode) -> Snapshot:
        self.calls.append((config, proxy.id))
        if proxy.id in self.failing:
            raise ValueError("mesh has no room for you")
        snapshot = build(config, proxy)
        big = config.raw.get("big")
        if big and "slow" in proxy.id:
            snapshot[CLUSTER_TYPE]["big"] = Cluster(name="big", alt_stat_name=big)
        return snapshot

    def sotw(self, node: Node | None = SLEEP_NODE, *, collect: bool = True) -> Client:
        self.clients.append(Client(self.stub.StreamAggregatedResources(), node, delta=False, collect=collect))
        return self.clients[-1]

    def delta(self, node: Node | None = SLEEP_NODE) -> Client:
        self.clients.append(Client(self.stub.DeltaAggregatedResources(), node, delta=True))
        return self.clients[-1]

    async def computed(self, config: MeshConfig, node: Node) -> None:
        """Wait until the server built ``node``'s snapshot from ``config`` (a push was handled)."""
        async with asyncio.timeout(RESPONSE_WAIT):
            while not any(c is config and nid == node.id for c, nid in self.calls):
                await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        await self.ads.close()
        await self.channel.close()
        await self.server.stop(0)


@pytest.fixture
async def make_harness() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    harnesses: list[Harness] = []

    async def factory(
        config: MeshConfig | None = None,
        authorize: Authorizer | None = None,
        debug_access: DebugAccess | None = None,
    ) -> Harness:
        harness = Harness(config or mesh(), authorize, debug_access)
        await harness.start()
        harnesses.append(harness)
        return harness

    yield factory
    for harness in harnesses:
        await harness.stop()


@pytest.fixture
async def h(make_harness: Callable[..., Awaitable[Harness]]) -> Harness:
    return await make_harness()


def status_of(h: Harness, type_url: str, index: int = 0) -> TypeStatus:
    return h.ads.connections()[index].types[type_url]


# -- state of the world -------------------------------------------------------------------------------


async def test_sotw_cds_is_wildcard_and_an_ack_sends_nothing(h: Harness) -> None:
    client = h.sotw()
    await client.request(CLUSTER_TYPE, ["ignored-name"])
    response = await client.response(CLUSTER_TYPE)
    assert clusters_of(response) == {"a": "1", "b": "1"}
    assert response.version_info and response.nonce
    assert json.loads(response.control_plane.identifier)["ID"] == "cp-test"
    assert status_of(h, CLUSTER_TYPE).config_status == "STALE"

    await client.ack(response)
    await client.barrier()  # the ACK produced no response
    status = status_of(h, CLUSTER_TYPE)
    assert status.sent_nonce == status.acked_nonce == response.nonce
    assert status.config_status == "SYNCED" and status.version == response.version_info
    assert h.sample("controlplane_xds_pushes", type_url=CLUSTER_TYPE) == 1
    assert h.observer.acks == [(h.ads.connections()[0].conn_id, CLUSTER_TYPE, response.nonce, None)]

    # Same content, same version: the version is a function of the content, not of time.
    await client.request(CLUSTER_TYPE)
    again = await client.response(CLUSTER_TYPE)
    assert again.version_info == response.version_info and again.nonce != response.nonce


async def test_sotw_nack_sends_nothing_and_shows_error(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    client = h.sotw()
    await client.request(LISTENER_TYPE)
    response = await client.response(LISTENER_TYPE)
    with caplog.at_level(logging.WARNING, logger="istio.ads"):
        await client.request(LISTENER_TYPE, nonce=response.nonce, error_message="listener l1: bad port")
        configs = await client.barrier()  # no resend after the NACK
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert LISTENER_TYPE in warnings[0] and "listener l1: bad port" in warnings[0]
    assert h.sample("controlplane_xds_nacks", type_url=LISTENER_TYPE) == 1

    entry = configs[0].generic_xds_configs[0]
    assert entry.type_url == LISTENER_TYPE
    assert entry.config_status == csds_pb2.ConfigStatus.ERROR
    assert entry.error_state.details == "listener l1: bad port"
    assert h.ads.connections()[0].last_error == "listener l1: bad port"

    # The next push is sent anyway; its ACK clears the error.
    new = mesh(listeners={"l1": 2})
    await h.ads.update_mesh(new)
    pushed = await client.response(LISTENER_TYPE)
    assert pushed.version_info != response.version_info
    await client.ack(pushed)
    configs = await client.barrier()
    assert configs[0].generic_xds_configs[0].config_status == csds_pb2.ConfigStatus.SYNCED
    assert not configs[0].generic_xds_configs[0].HasField("error_state")


async def test_sotw_eds_serves_only_requested_names(h: Harness) -> None:
    client = h.sotw()
    await client.request(ENDPOINT_TYPE, ["a", "missing"])
    first = await client.response(ENDPOINT_TYPE)
    assert names_of(first) == ["a"]

    await client.ack(first, ["a", "b"])  # an ACK that changes the names is answered
    second = await client.response(ENDPOINT_TYPE)
    assert names_of(second) == ["a", "b"]
    assert second.version_info != first.version_info

    await client.ack(second, ["b", "a"])  # same set: nothing
    await client.barrier()
    assert status_of(h, ENDPOINT_TYPE).config_status == "SYNCED"

    await client.ack(second, [])  # no names: unsubscribed, nothing sent
    await client.barrier()
    assert ENDPOINT_TYPE not in h.ads.connections()[0].types


async def test_sotw_push_sends_only_changed_types_in_order(h: Harness) -> None:
    client = h.sotw()
    old = {}
    for type_url, names in [
        (CLUSTER_TYPE, []),
        (ENDPOINT_TYPE, ["a", "b"]),
        (LISTENER_TYPE, []),
        (ROUTE_TYPE, ["r1"]),
        (NAME_TABLE_TYPE, []),
    ]:
        old[type_url] = await client.subscribe(type_url, names)
    table = unpack(old[NAME_TABLE_TYPE].resources[0], nds_pb2.NameTable())
    assert list(table.table) == ["a.default.svc.cluster.local"]

    # Changing what this proxy does not watch (route r2) pushes nothing.
    unwatched = mesh(routes={"r1": 1, "r2": 2})
    await h.ads.update_mesh(unwatched)
    await h.computed(unwatched, SLEEP_NODE)
    await client.barrier()

    # Routes and clusters change; endpoints, listeners and names do not.
    changed = mesh(clusters={"a": 1, "b": 2}, routes={"r1": 2, "r2": 2})
    await h.ads.update_mesh(changed)
    cds = await client.response()
    rds = await client.response()
    assert (cds.type_url, rds.type_url) == (CLUSTER_TYPE, ROUTE_TYPE)  # make before break
    assert clusters_of(cds) == {"a": "1", "b": "2"}
    assert cds.version_info != old[CLUSTER_TYPE].version_info
    assert rds.version_info != old[ROUTE_TYPE].version_info and names_of(rds) == ["r1"]
    await client.barrier()  # EDS, LDS and NDS were not resent
    statuses = h.ads.connections()[0].types
    assert statuses[ENDPOINT_TYPE].config_status == "SYNCED"
    assert statuses[CLUSTER_TYPE].config_status == "STALE"  # pushed, not yet ACKed


async def test_sotw_stale_nonce_is_ignored(h: Harness) -> None:
    client = h.sotw()
    await client.request(CLUSTER_TYPE)
    first = await client.response(CLUSTER_TYPE)
    await h.ads.update_mesh(mesh(clusters={"a": 2}))
    second = await client.response(CLUSTER_TYPE)
    assert clusters_of(second) == {"a": "2"}

    await client.ack(first)  # ACK of a superseded response
    await client.request(ENDPOINT_TYPE, ["a"])
    eds = await client.response(ENDPOINT_TYPE)
    await client.request(ENDPOINT_TYPE, ["a", "b"], nonce=first.nonce)  # stale: ignored, names too
    await client.barrier()
    assert status_of(h, CLUSTER_TYPE).acked_nonce == ""
    assert status_of(h, CLUSTER_TYPE).config_status == "STALE"
    assert names_of(eds) == ["a"]

    await client.ack(second)
    await client.barrier()
    assert status_of(h, CLUSTER_TYPE).config_status == "SYNCED"


async def test_sotw_first_request_with_a_nonce_is_a_subscription(h: Harness) -> None:
    # Envoy reconnecting after a control plane restart still carries its last nonce.
    client = h.sotw()
    await client.request(CLUSTER_TYPE, nonce="nonce-from-another-server", version="old")
    assert clusters_of(await client.response(CLUSTER_TYPE)) == {"a": "1", "b": "1"}


@pytest.mark.parametrize("node", [None, Node(), Node(cluster="no-id")])
async def test_missing_node_is_rejected(h: Harness, node: Node | None) -> None:
    client = h.sotw(node=node)
    await client.request(CLUSTER_TYPE)
    failure = await client.end()
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "missing node" in (failure.details() or "")
    assert h.ads.connections() == []


async def test_delta_missing_node_is_rejected(h: Harness) -> None:
    client = h.delta(node=None)
    await client.delta_request(CLUSTER_TYPE)
    failure = await client.end()
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_and_empty_types_are_ignored(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    client = h.sotw()
    with caplog.at_level(logging.WARNING, logger="istio.ads"):
        await client.request(UNKNOWN_TYPE, ["x"])
        await client.request("type.googleapis.com/example.Other")
        await client.request("")
        await client.barrier()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and UNKNOWN_TYPE in warnings[0]
    assert h.sample("controlplane_xds_unknown_type") == 2
    # The stream is still usable.
    response = await client.subscribe(CLUSTER_TYPE)
    assert clusters_of(response) == {"a": "1", "b": "1"}


async def test_nack_without_a_sent_response_is_ignored(h: Harness) -> None:
    client = h.sotw()
    await client.request(CLUSTER_TYPE, error_message="nothing to reject yet")
    await client.barrier()
    assert h.ads.connections()[0].types == {}
    assert h.ads.connections()[0].last_error is None
    assert clusters_of(await client.subscribe(CLUSTER_TYPE)) == {"a": "1", "b": "1"}


# -- delta ---------------------------------------------------------------------------------------------


def delta_versions(response: discovery_pb2.DeltaDiscoveryResponse) -> dict[str, str]:
    return {r.name: r.version for r in response.resources}


async def test_delta_wildcard_subscribe(h: Harness) -> None:
    client = h.delta()
    await client.delta_request(CLUSTER_TYPE)
    response = await client.response(CLUSTER_TYPE)
    snapshot = build(h.ads.mesh, ProxyNode.from_node(SLEEP_NODE))[CLUSTER_TYPE]
    assert delta_versions(response) == {n: resource_version(m) for n, m in snapshot.items()}
    assert unpack(response.resources[0].resource, Cluster()).name == response.resources[0].name
    assert response.system_version_info and response.nonce and not response.removed_resources

    await client.ack(response)
    await client.barrier()
    status = status_of(h, CLUSTER_TYPE)
    assert status.config_status == "SYNCED" and status.resources == 2
    assert h.ads.connections()[0].flavour == "delta"

    # "*" is wildcard too; with no resources of the type there is still a first (empty) answer.
    await client.delta_request(ROUTE_TYPE, ["*"])  # RDS is never wildcard: "*" is ignored
    empty = await client.response(ROUTE_TYPE)
    assert list(empty.resources) == []
    await client.delta_request(LISTENER_TYPE, ["*"])
    assert list(delta_versions(await client.response(LISTENER_TYPE))) == ["l1"]


async def test_delta_initial_resource_versions_suppress_resend(h: Harness) -> None:
    snapshot = build(h.ads.mesh, ProxyNode.from_node(SLEEP_NODE))[CLUSTER_TYPE]
    client = h.delta()
    initial = {"a": resource_version(snapshot["a"]), "b": "outdated", "gone": "whatever"}
    await client.delta_request(CLUSTER_TYPE, initial=initial)
    response = await client.response(CLUSTER_TYPE)
    assert list(delta_versions(response)) == ["b"]
    assert list(response.removed_resources) == ["gone"]

    other = h.delta(OTHER_NODE)
    all_current = {name: resource_version(message) for name, message in snapshot.items()}
    await other.delta_request(CLUSTER_TYPE, initial=all_current)
    assert list((await other.response(CLUSTER_TYPE)).resources) == []


async def test_delta_subscribe_and_unsubscribe_by_name(h: Harness) -> None:
    client = h.delta()
    first = await client.subscribe(ENDPOINT_TYPE, ["a"])
    assert list(delta_versions(first)) == ["a"]
    await client.delta_request(ENDPOINT_TYPE, ["b"])
    second = await client.response(ENDPOINT_TYPE)
    assert list(delta_versions(second)) == ["b"]  # only the newly subscribed name
    await client.ack(second)

    await client.delta_request(ENDPOINT_TYPE, unsubscribe=["a"])
    await client.barrier()  # unsubscribing sends nothing

    # a is no longer watched: its change is not pushed; b's is.
    await h.ads.update_mesh(mesh(endpoints={"a": 5, "b": 6}))
    pushed = await client.response(ENDPOINT_TYPE)
    assert list(delta_versions(pushed)) == ["b"] and not pushed.removed_resources
    await client.barrier()


async def test_delta_removal_after_mesh_update(h: Harness) -> None:
    client = h.delta()
    first = await client.subscribe(CLUSTER_TYPE)
    assert set(delta_versions(first)) == {"a", "b"}
    await h.ads.update_mesh(mesh(clusters={"a": 1, "c": 1}))
    pushed = await client.response(CLUSTER_TYPE)
    assert list(delta_versions(pushed)) == ["c"]
    assert list(pushed.removed_resources) == ["b"]
    assert pushed.system_version_info != first.system_version_info


async def test_delta_nack_sends_nothing(h: Harness) -> None:
    client = h.delta()
    await client.delta_request(LISTENER_TYPE)
    response = await client.response(LISTENER_TYPE)
    await client.delta_request(LISTENER_TYPE, nonce=response.nonce, error_message="no")
    configs = await client.barrier()
    assert configs[0].generic_xds_configs[0].config_status == csds_pb2.ConfigStatus.ERROR
    assert configs[0].generic_xds_configs[0].error_state.details == "no"
    assert h.observer.acks[-1][2:] == (response.nonce, "no")


# -- syncz ---------------------------------------------------------------------------------------------


async def test_syncz_lists_proxies_with_their_statuses(h: Harness) -> None:
    sleep = h.sotw()
    await sleep.subscribe(CLUSTER_TYPE)  # SYNCED
    await sleep.request(LISTENER_TYPE)
    listeners = await sleep.response(LISTENER_TYPE)
    await sleep.request(LISTENER_TYPE, nonce=listeners.nonce, error_message="boom")  # ERROR
    await sleep.request(ENDPOINT_TYPE, ["a"])
    await sleep.response(ENDPOINT_TYPE)  # not ACKed: STALE
    await sleep.barrier()

    httpbin = h.delta(OTHER_NODE)
    await httpbin.subscribe(CLUSTER_TYPE)
    await httpbin.barrier()

    istioctl = h.sotw(ISTIOCTL_NODE)
    await istioctl.request(SYNCZ_TYPE)
    response = await istioctl.response(SYNCZ_TYPE)
    identifier = json.loads(response.control_plane.identifier)
    assert identifier["Component"] == "istiod" and identifier["ID"] == "cp-test"
    assert set(identifier["Info"]) >= {"version", "revision", "golang_version", "status", "tag"}

    configs = [unpack(r, csds_pb2.ClientConfig()) for r in response.resources]
    assert [c.node.id for c in configs] == ["httpbin-1.apps", "sleep-1.default"]  # istiod's proxy IDs
    httpbin_config, sleep_config = configs
    assert dict(sleep_config.node.metadata) == {
        "CLUSTER_ID": "Kubernetes",
        "NAMESPACE": "default",
        "ISTIO_VERSION": "1.31.0",
    }
    entries = sleep_config.generic_xds_configs
    assert [e.type_url for e in entries] == sorted([CLUSTER_TYPE, LISTENER_TYPE, ENDPOINT_TYPE])
    by_type = {e.type_url: e for e in entries}
    assert by_type[CLUSTER_TYPE].config_status == csds_pb2.ConfigStatus.SYNCED
    assert by_type[ENDPOINT_TYPE].config_status == csds_pb2.ConfigStatus.STALE
    assert by_type[LISTENER_TYPE].config_status == csds_pb2.ConfigStatus.ERROR  # istiod since 1.23
    assert by_type[LISTENER_TYPE].error_state.details == "boom"
    assert by_type[LISTENER_TYPE].error_state.last_update_attempt == by_type[LISTENER_TYPE].last_updated
    assert all(e.last_updated.seconds > 0 for e in entries)
    assert not by_type[CLUSTER_TYPE].HasField("error_state")
    assert [e.type_url for e in httpbin_config.generic_xds_configs] == [CLUSTER_TYPE]
    assert len(httpbin_config.node.metadata) == 0

    # The debug-only stream never needed a snapshot.
    assert all(node_id != ISTIOCTL_NODE.id for _, node_id in h.calls)


async def test_unknown_debug_type_fails_a_debug_client_and_is_ignored_on_a_proxy_stream(h: Harness) -> None:
    istioctl = h.sotw(ISTIOCTL_NODE)
    await istioctl.request("istio.io/debug/nonsense")
    failed = await istioctl.end()
    assert isinstance(failed, grpc.aio.AioRpcError)
    assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown debug type 'istio.io/debug/nonsense'" in (failed.details() or "")
    assert "istio.io/debug/syncz" in (failed.details() or "")

    # On a proxy's own stream (the agent's tap uses it) the question goes unanswered, the stream lives.
    sleep = h.sotw()
    await sleep.subscribe(CLUSTER_TYPE)
    await sleep.request("istio.io/debug/nonsense")
    configs = await sleep.barrier()  # the next answer is syncz's: nothing was sent for the unknown type
    assert [c.node.id for c in configs] == ["sleep-1.default"]


async def test_config_dump_for_a_connected_proxy_and_none_for_an_unknown_one(h: Harness) -> None:
    sleep = h.sotw()
    clusters = await sleep.subscribe(CLUSTER_TYPE)
    await sleep.subscribe(LISTENER_TYPE)

    istioctl = h.sotw(ISTIOCTL_NODE)
    await istioctl.request(CONFIG_DUMP_TYPE, ["sleep-1.default"])
    response = await istioctl.response(CONFIG_DUMP_TYPE)
    sections = [r.type_url.rpartition(".")[2] for r in response.resources]
    assert sections == [
        "ClustersConfigDump",
        "ListenersConfigDump",
        "RoutesConfigDump",
        "EndpointsConfigDump",
        "EcdsConfigDump",
    ]
    dumped = unpack(response.resources[0], ClustersConfigDump())
    names = [unpack(c.cluster, Cluster()).name for c in dumped.dynamic_active_clusters]
    assert names == sorted(unpack(r, Cluster()).name for r in clusters.resources)

    await istioctl.request(CONFIG_DUMP_TYPE, ["nobody.default"])
    assert list((await istioctl.response(CONFIG_DUMP_TYPE)).resources) == []


def test_config_status_values() -> None:
    base = TypeStatus(CLUSTER_TYPE, "", "", "", None, None, 0)
    assert base.config_status == "NOT_SENT"
    sent = TypeStatus(CLUSTER_TYPE, "n1", "", "v", None, 1.0, 1)
    assert sent.config_status == "STALE"
    assert TypeStatus(CLUSTER_TYPE, "n1", "n1", "v", None, 1.0, 1).config_status == "SYNCED"
    assert TypeStatus(CLUSTER_TYPE, "n1", "n1", "v", "bad", 1.0, 1).config_status == "ERROR"  # NACKed
    assert TypeStatus(CLUSTER_TYPE, "n2", "n1", "v", "bad", 1.0, 1).config_status == "ERROR"  # until ACKed


# -- connections, pushes, lifecycle --------------------------------------------------------------------


async def test_two_connections_both_receive_a_push(h: Harness) -> None:
    one, two = h.sotw(), h.delta(OTHER_NODE)
    await one.subscribe(CLUSTER_TYPE)
    await two.subscribe(CLUSTER_TYPE)
    assert h.sample("controlplane_xds_connections", flavour="sotw") == 1
    assert h.sample("controlplane_xds_connections", flavour="delta") == 1
    assert [(c.node_id, c.flavour) for c in h.ads.connections()] == [
        (SLEEP_NODE.id, "sotw"),
        (OTHER_NODE.id, "delta"),
    ]

    await h.ads.update_mesh(mesh(clusters={"a": 1, "b": 3}))
    assert clusters_of(await one.response(CLUSTER_TYPE)) == {"a": "1", "b": "3"}
    assert list(delta_versions(await two.response(CLUSTER_TYPE))) == ["b"]

    await one.close()
    async with asyncio.timeout(RESPONSE_WAIT):
        while len(h.ads.connections()) != 1:
            await asyncio.sleep(0.01)
    assert h.sample("controlplane_xds_connections", flavour="sotw") == 0


async def test_a_client_that_never_reads_does_not_block_others(h: Harness) -> None:
    slow_node = Node(id="sidecar~10.0.0.9~slow-1.default~default.svc.cluster.local")
    await h.ads.update_mesh(MeshConfig(raw={**mesh().raw, "big": "x" * 2_000_000 + "0"}))
    slow = h.sotw(slow_node, collect=False)  # never reads a response
    await slow.request(CLUSTER_TYPE)
    await h.computed(h.ads.mesh, slow_node)  # registered (and answered) before the fast one connects
    fast = h.sotw()
    await fast.subscribe(CLUSTER_TYPE)
    slow_id, fast_id = (c.conn_id for c in h.ads.connections())

    rounds = 12
    for i in range(1, rounds + 1):
        config = MeshConfig(raw={**mesh(clusters={"a": i}).raw, "big": "x" * 2_000_000 + str(i)})
        await asyncio.wait_for(h.ads.update_mesh(config), 1.0)
        assert clusters_of(await fast.response(CLUSTER_TYPE))["a"] == str(i)

    # The slow stream's writer is stuck in flow control; its pushes coalesced instead of queueing.
    slow_written = [p for p in h.observer.pushes if p[0] == slow_id]
    fast_written = [p for p in h.observer.pushes if p[0] == fast_id]
    assert len(fast_written) == rounds + 1
    assert len(slow_written) < rounds // 2

    # close() still ends everything promptly, including the stuck writer.
    await asyncio.wait_for(h.ads.close(), RESPONSE_WAIT)
    assert h.ads.connections() == []
    assert await fast.end() is grpc.aio.EOF
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("ads-")]


async def test_authorize_refusal_ends_the_stream_with_its_status(
    make_harness: Callable[..., Awaitable[Harness]],
) -> None:
    seen: list[ProxyNode] = []

    async def authorize(call: Call, proxy: ProxyNode) -> str | None:
        seen.append(proxy)
        if proxy.id == OTHER_NODE.id:
            await call.abort(Status.PERMISSION_DENIED, "not on the guest list")
        return None

    h = await make_harness(authorize=authorize)
    refused = h.sotw(OTHER_NODE)
    await refused.request(CLUSTER_TYPE)
    failure = await refused.end()
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() == grpc.StatusCode.PERMISSION_DENIED
    assert failure.details() == "not on the guest list"
    assert all(node_id != OTHER_NODE.id for _, node_id in h.calls)  # nothing computed or sent

    allowed = h.delta()
    await allowed.subscribe(CLUSTER_TYPE)
    await allowed.subscribe(LISTENER_TYPE)
    assert [p.id for p in seen] == [OTHER_NODE.id, SLEEP_NODE.id]  # once per stream
    assert seen[1].namespace == "default"
    assert [c.node_id for c in h.ads.connections()] == [SLEEP_NODE.id]


async def test_a_server_added_without_authorization_never_asks_the_authorizer() -> None:
    """The plaintext port (istiod's 15010) asks no identity; the same AdsServer's TLS port does."""
    asked: list[str] = []

    async def refuse(call: Call, proxy: ProxyNode) -> str | None:
        asked.append(proxy.id)
        await call.abort(Status.UNAUTHENTICATED, "prove who you are")

    ads = AdsServer(mesh(), build, authorize=refuse, registry=Registry())
    plain, secured = RpcServer(), RpcServer()
    ads.add_to(plain, authorize=False)
    ads.add_to(secured)
    try:
        for server in (plain, secured):
            await server.start(host="127.0.0.1", port=0)
        ports = [server.sockets()[0].getsockname()[1] for server in (plain, secured)]
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as to_plain,
            grpc.aio.insecure_channel(f"127.0.0.1:{ports[1]}") as to_secured,
        ):
            served = Client(
                ads_pb2_grpc.AggregatedDiscoveryServiceStub(to_plain).StreamAggregatedResources(),
                SLEEP_NODE,
                delta=False,
            )
            await served.request(CLUSTER_TYPE)
            assert (await served.response(CLUSTER_TYPE)).type_url == CLUSTER_TYPE
            assert asked == []
            refused = Client(
                ads_pb2_grpc.AggregatedDiscoveryServiceStub(to_secured).StreamAggregatedResources(),
                SLEEP_NODE,
                delta=False,
            )
            await refused.request(CLUSTER_TYPE)
            failure = await refused.end()
            assert isinstance(failure, grpc.aio.AioRpcError)
            assert (failure.code(), failure.details()) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "prove who you are",
            )
            assert asked == [SLEEP_NODE.id]
            await served.close()
    finally:
        await ads.close()
        for server in (plain, secured):
            await server.stop(0)


async def test_close_ends_streams_with_ok(h: Harness) -> None:
    sotw, delta = h.sotw(), h.delta(OTHER_NODE)
    await sotw.subscribe(CLUSTER_TYPE)
    await delta.subscribe(CLUSTER_TYPE)
    await h.ads.close()
    assert await sotw.end() is grpc.aio.EOF
    assert await delta.end() is grpc.aio.EOF
    assert await sotw.call.code() == grpc.StatusCode.OK
    assert h.ads.connections() == []
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("ads-")]

    late = h.sotw()
    await late.request(CLUSTER_TYPE)
    failure = await late.end()
    assert isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_half_close_ends_the_stream_after_answering(h: Harness) -> None:
    client = h.sotw()
    await client.request(CLUSTER_TYPE)
    await client.call.done_writing()
    assert clusters_of(await client.response(CLUSTER_TYPE)) == {"a": "1", "b": "1"}
    assert await client.end() is grpc.aio.EOF
    async with asyncio.timeout(RESPONSE_WAIT):
        while h.ads.connections():
            await asyncio.sleep(0.01)


async def test_snapshot_failure_ends_only_that_stream(h: Harness) -> None:
    h.failing.add(OTHER_NODE.id)
    healthy = h.sotw()
    await healthy.subscribe(CLUSTER_TYPE)
    broken = h.sotw(OTHER_NODE)
    await broken.request(CLUSTER_TYPE)
    failure = await broken.end()
    assert isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.INTERNAL
    assert "mesh has no room for you" in (failure.details() or "")

    # A failing push keeps the stream and what it had.
    h.failing.add(SLEEP_NODE.id)
    bad = mesh(clusters={"z": 1})
    await h.ads.update_mesh(bad)
    await h.computed(bad, SLEEP_NODE)
    await healthy.barrier()
    h.failing.clear()
    await h.ads.update_mesh(mesh(clusters={"y": 1}))
    assert clusters_of(await healthy.response(CLUSTER_TYPE)) == {"y": "1"}


# -- as strict as istiod: node ids, who may ask debug questions ------------------------------------------


async def test_a_node_id_istiod_refuses_ends_the_stream_with_istiods_error(h: Harness) -> None:
    node = Node(id="istioctl~0.0.0.0~agentctl.istio-system~istio-system.svc.cluster.local")
    client = h.sotw(node)
    await client.request(SYNCZ_TYPE)
    failure = await client.end()
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.details() == (
        f'invalid node type (valid types: [sidecar router waypoint ztunnel]) in the service node "{node.id}"'
    )
    assert h.ads.connections() == []


def _identity_by_node(identities: dict[str, str]) -> Authorizer:
    async def authorize(call: Call, proxy: ProxyNode) -> str | None:
        return identities.get(proxy.id)

    return authorize


async def test_debug_questions_need_a_verified_identity_and_see_only_its_namespace(
    make_harness: Callable[..., Awaitable[Harness]],
) -> None:
    asker_default = Node(id="sidecar~10.0.0.7~test-1.default~default.svc.cluster.local")
    asker_system = Node(id="sidecar~10.0.0.8~test-1.istio-system~istio-system.svc.cluster.local")
    asker_allowed = Node(id="sidecar~10.0.0.9~test-1.monitoring~monitoring.svc.cluster.local")
    identities = {
        asker_default.id: "spiffe://cluster.local/ns/default/sa/default",
        asker_system.id: "spiffe://cluster.local/ns/istio-system/sa/default",
        asker_allowed.id: "spiffe://cluster.local/ns/monitoring/sa/prometheus",
    }
    h = await make_harness(
        authorize=_identity_by_node(identities),
        debug_access=DebugAccess(allowed_namespaces=frozenset({"monitoring"})),
    )
    for node in (SLEEP_NODE, OTHER_NODE):
        await h.sotw(node).subscribe(CLUSTER_TYPE)

    anonymous = h.sotw(ISTIOCTL_NODE)  # no identity: the plaintext port
    await anonymous.request(SYNCZ_TYPE)
    failure = await anonymous.end()
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() == grpc.StatusCode.UNAUTHENTICATED
    assert failure.details() == "authentication required"

    async def seen(node: Node) -> list[str]:
        client = h.sotw(node)
        await client.request(SYNCZ_TYPE)
        response = await client.response(SYNCZ_TYPE)
        return [unpack(r, csds_pb2.ClientConfig()).node.id for r in response.resources]

    assert await seen(asker_system) == ["httpbin-1.apps", "sleep-1.default"]
    assert await seen(asker_allowed) == ["httpbin-1.apps", "sleep-1.default"]
    assert await seen(asker_default) == ["sleep-1.default"]

    dumper = h.sotw(asker_default)
    await dumper.request(CONFIG_DUMP_TYPE, ["httpbin-1.apps"])  # another namespace's: as if unknown
    assert list((await dumper.response(CONFIG_DUMP_TYPE)).resources) == []
    await dumper.request(CONFIG_DUMP_TYPE, ["sleep-1.default"])
    assert len((await dumper.response(CONFIG_DUMP_TYPE)).resources) == 5


async def test_syncz_lists_only_proxies_not_debug_clients_or_proxyless_apps(h: Harness) -> None:
    proxyless = Node(id="sidecar~10.0.0.3~echo-1.default~default.svc.cluster.local")
    proxyless.metadata["GENERATOR"] = "grpc"  # a gRPC app's bootstrap: no PROXY_CONFIG
    await h.sotw(proxyless).subscribe(LISTENER_TYPE, ["echo.default.svc.cluster.local:8080"])
    await h.sotw(SLEEP_NODE).subscribe(CLUSTER_TYPE)
    istioctl = h.sotw(ISTIOCTL_NODE)
    await istioctl.request(SYNCZ_TYPE)
    response = await istioctl.response(SYNCZ_TYPE)
    assert [unpack(r, csds_pb2.ClientConfig()).node.id for r in response.resources] == ["sleep-1.default"]


def test_debug_access_from_istiods_variables() -> None:
    assert DebugAccess.from_env({}) == DebugAccess()
    assert DebugAccess.from_env({"ENABLE_DEBUG_ENDPOINT_AUTH": "false"}).enabled is False
    access = DebugAccess.from_env({"DEBUG_ENDPOINT_AUTH_ALLOWED_NAMESPACES": "monitoring, ops,"})
    assert access.allowed_namespaces == {"monitoring", "ops"}
    with pytest.raises(ValueError, match="ENABLE_DEBUG_ENDPOINT_AUTH"):
        DebugAccess.from_env({"ENABLE_DEBUG_ENDPOINT_AUTH": "maybe"})
