"""The xDS stream core over real gRPC: what any server built on it gets, and a debug tap built on it.

The SDS server and the control plane's ADS have their own behaviour tests
(``tests/security/test_sds.py``, ``tests/controlplane/test_ads.py``); these cover the core itself
with small sources, including the agent's coming debug tap, which answers every
``istio.io/debug/*`` query by asking istiod (slow, and failing now and then) without any change
to the core.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc
import pytest
from envoy.config.cluster.v3.cluster_pb2 import Cluster
from envoy.config.core.v3.base_pb2 import Node
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from istio_agent.rpc import Status
from istio_agent.rpc.call import Call
from istio_agent.rpc.server import RpcServer
from istio_agent.xds import flavour as xds_flavour
from istio_agent.xds.flavour import ADS_SERVICE, DELTA, SOTW, Flavour, Request, Resource, Resources, Response
from istio_agent.xds.stream import Change, Reply, Source, Stream, StreamError, StreamServer, require_node
from tests.xds import CDS, WAIT, EnvoyStream

NODE = Node(id="sidecar~10.0.0.1~app-1.default~default.svc.cluster.local")
SYNCZ = "istio.io/debug/syncz"
CONFIG_DUMP = "istio.io/debug/config_dump"
log = logging.getLogger("istio.streamtest")


class Clusters(Source[None, str]):
    """A tiny generator: named clusters whose content a test changes, then pushes by name."""

    def __init__(self) -> None:
        self.clusters = {name: Cluster(name=name) for name in ("a", "b")}
        self.broken = False
        self.sent_names: list[tuple[str, list[str]]] = []

    async def open(self, request: Request, call: Call, flavour: Flavour) -> None:
        require_node(request)

    def watched_type(self, stream: Stream[None, str], type_url: str) -> str | None:
        return type_url if type_url == CDS else None

    async def resources(
        self, stream: Stream[None, str], type_url: str, names: Sequence[str] | None
    ) -> Resources:
        if self.broken:
            raise KeyError("a bug in the generator")
        chosen = sorted(self.clusters) if names is None else [n for n in names if n in self.clusters]
        versions = {name: xds_flavour.resource_version(cluster) for name, cluster in self.clusters.items()}
        return Resources(chosen, self.clusters, versions)

    def version(self, type_url: str, versions: Iterable[tuple[str, str]]) -> str:
        return ",".join(f"{name}={version}" for name, version in sorted(versions))

    def changes(self, stream: Stream[None, str], event: str) -> Iterable[Change]:
        return [(CDS, [event])]

    def sent(self, stream: Stream[None, str], response: Response, names: list[str], cause: str) -> None:
        self.sent_names.append((cause, names))


class FakeIstiod:
    """What the tap forwards to: answers after a delay; a query naming "fail" fails, "late" times out."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    async def query(self, request: Request) -> discovery_pb2.DiscoveryResponse | None:
        flavour = SOTW if isinstance(request, discovery_pb2.DiscoveryRequest) else DELTA
        names = flavour.requested_names(request)
        self.queries.append(request.type_url)
        await asyncio.sleep(0.05)
        if "fail" in names:
            raise ConnectionError("istiod is not connected")
        if "late" in names:
            return None
        config = any_pb2.Any(type_url=request.type_url, value=b"dump of " + ",".join(names).encode())
        return discovery_pb2.DiscoveryResponse(
            version_info="v7", resources=[config], type_url=request.type_url
        )


class DebugTap(Source[None, None]):
    """The agent's debug tap, as the stream core's docstring sketches it: every query goes to istiod."""

    def __init__(self, istiod: FakeIstiod) -> None:
        self._istiod = istiod

    async def open(self, request: Request, call: Call, flavour: Flavour) -> None:
        return None  # no node needed: istiod answers for the pod's own proxy

    def is_query(self, type_url: str) -> bool:
        return type_url.startswith("istio.io/debug")

    async def answer(self, stream: Stream[None, None], request: Request) -> Reply | None:
        try:
            response = await self._istiod.query(request)
        except ConnectionError as err:
            raise StreamError(Status.UNAVAILABLE, str(err)) from err
        if response is None:
            return None
        return Reply([Resource("", resource) for resource in response.resources], response.version_info)


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    """serve(source) -> (core, open_stream): the core on the agent's gRPC server on loopback, grpcio's client."""
    servers: list[tuple[RpcServer, grpc.aio.Channel, StreamServer[Any, Any]]] = []
    streams: list[EnvoyStream] = []

    async def factory(source: Source[Any, Any]) -> tuple[StreamServer[Any, Any], Callable[..., EnvoyStream]]:
        core: StreamServer[Any, Any] = StreamServer(source, name="test", log=log, describe="test server")
        server = RpcServer()
        core.add_to(server, ADS_SERVICE, {SOTW.method: SOTW, DELTA.method: DELTA})
        await server.start(host="127.0.0.1", port=0)
        port = server.sockets()[0].getsockname()[1]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append((server, channel, core))

        def open_stream(*, delta: bool = False) -> EnvoyStream:
            streams.append(EnvoyStream(channel, delta=delta))
            return streams[-1]

        return core, open_stream

    yield factory
    for stream in streams:
        await stream.close()
    for server, channel, core in servers:
        await core.close()
        await channel.close()
        await server.stop(0)


async def written(source: Clusters, count: int) -> None:
    """Wait until the server's writes have returned too: the client may see a response first."""
    async with asyncio.timeout(WAIT):
        while len(source.sent_names) < count:
            await asyncio.sleep(0.01)


# -- the debug tap -------------------------------------------------------------------------------------


async def test_debug_tap_answers_each_query_with_what_istiod_returns(serve: Any) -> None:
    istiod = FakeIstiod()
    core, open_stream = await serve(DebugTap(istiod))
    client = open_stream()
    await client.send(SYNCZ)  # no node: the tap does not ask for one
    await client.send(CONFIG_DUMP, resource_names=["app-1.default"])
    first, second = await client.recv(), await client.recv()
    assert (first.type_url, second.type_url) == (SYNCZ, CONFIG_DUMP)
    assert second.version_info == "v7" and second.nonce
    assert second.resources[0].value == b"dump of app-1.default"  # relayed as istiod sent it
    assert istiod.queries == [SYNCZ, CONFIG_DUMP]

    # istiod timing out answers nothing and keeps the stream; an ACK of an answer is not a query.
    await client.send(SYNCZ, resource_names=["late"])
    await client.send(SYNCZ, response_nonce=first.nonce)
    await client.expect_silence()
    assert istiod.queries == [SYNCZ, CONFIG_DUMP, SYNCZ]
    await client.send(SYNCZ, resource_names=["again"])
    assert (await client.recv()).resources[0].value == b"dump of again"

    # A failed query ends the stream with its status; other streams go on.
    other = open_stream(delta=True)
    await other.send(SYNCZ, resource_names_subscribe=["x"])
    answer = await other.recv()
    assert isinstance(answer, discovery_pb2.DeltaDiscoveryResponse) and answer.system_version_info == "v7"
    await client.send(SYNCZ, resource_names=["fail"])
    assert await client.status() == (grpc.StatusCode.UNAVAILABLE, "istiod is not connected")
    await other.send(SYNCZ, resource_names_subscribe=["y"])
    assert (await other.recv()).resources[0].resource.value == b"dump of y"
    assert [stream.id for stream in core.streams()] == [2]


async def test_debug_tap_drops_types_it_does_not_serve(serve: Any) -> None:
    _, open_stream = await serve(DebugTap(FakeIstiod()))
    client = open_stream()
    await client.send(CDS, node=NODE)
    await client.expect_silence()
    await client.send(SYNCZ)
    assert (await client.recv()).type_url == SYNCZ


# -- the core's own guarantees ---------------------------------------------------------------------------


async def test_first_request_is_checked_by_the_source(serve: Any) -> None:
    core, open_stream = await serve(Clusters())
    client = open_stream()
    await client.send(CDS, resource_names=["a"])
    assert await client.status() == (grpc.StatusCode.INVALID_ARGUMENT, "missing node information")
    assert core.streams() == []


async def test_a_bug_in_a_source_ends_only_its_stream_loudly(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    source = Clusters()
    _, open_stream = await serve(source)
    healthy = open_stream()
    await healthy.send(CDS, resource_names=["a"], node=NODE)
    await healthy.recv()

    source.broken = True
    broken = open_stream(delta=True)
    with caplog.at_level(logging.ERROR, logger=log.name):
        await broken.send(CDS, resource_names_subscribe=["a"], node=NODE)
        assert await broken.status() == (grpc.StatusCode.INTERNAL, "internal error in the test server")
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "internal error" in record.getMessage() and record.exc_info is not None  # with its traceback

    source.broken = False
    await healthy.send(CDS, resource_names=["a", "b"])
    assert [r.type_url for r in (await healthy.recv()).resources] == [CDS, CDS]


async def test_requests_go_before_pushes_and_pushes_of_a_key_coalesce(serve: Any) -> None:
    source = Clusters()
    core, open_stream = await serve(source)
    client = open_stream()
    await client.send(CDS, resource_names=["a", "b"], node=NODE)
    first = await client.recv()
    [stream] = core.streams()
    for i in range(100):
        source.clusters["a"] = Cluster(name="a", alt_stat_name=str(i))
        stream.push("a", key="a")
    stream.push("b", key="b")
    assert list(stream.pending) == ["a", "b"]
    pushed_a, pushed_b = await client.recv(), await client.recv()
    assert [Cluster.FromString(r.value).alt_stat_name for r in pushed_a.resources] == ["99"]
    assert len(pushed_b.resources) == 1 and pushed_b.nonce != first.nonce
    await written(source, 3)
    assert source.sent_names == [("request", ["a", "b"]), ("push", ["a"]), ("push", ["b"])]


async def test_close_ends_streams_with_ok_and_refuses_new_ones(serve: Any) -> None:
    source = Clusters()
    core, open_stream = await serve(source)
    client = open_stream()
    await client.send(CDS, resource_names=["a"], node=NODE)
    await client.recv()
    await written(source, 1)
    await core.close()
    assert await client.status() == (grpc.StatusCode.OK, "")
    late = open_stream()
    await late.send(CDS, resource_names=["a"], node=NODE)
    got = await late.status()
    assert got == (grpc.StatusCode.UNAVAILABLE, "test server is shutting down")
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("test-")]
