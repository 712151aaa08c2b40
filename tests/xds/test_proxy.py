"""The xDS proxy over a real Unix socket, between a real gRPC client (Envoy) and a fake istiod on loopback."""

from __future__ import annotations

import asyncio
import logging
import socket
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import Node
from envoy.config.listener.v3 import listener_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.rpc import status_pb2

from istio_agent import uds
from istio_agent.config import XdsSettings
from istio_agent.metrics import PREFIX, Registry
from istio_agent.protos import nds_pb2, proxy_config_pb2
from istio_agent.xds.handlers import NameTableHandler, ProxyConfigHandler
from istio_agent.xds.proxy import XdsProxy
from istio_agent.xds.types import HEALTH_INFO, NAME_TABLE, PROXY_CONFIG, WORKLOAD
from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem
from tests.uds_clients import idle_http2_client, silent_client
from tests.xds import CDS, LDS, WAIT, EnvoyStream, FakeIstiod, FakeUpstreamStream, running

NODE = Node(id="sidecar~10.0.0.1~app-1.default~default.svc.cluster.local")
FLAVOURS = pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])


def settings_for(workdir: Path, address: str, **changes: Any) -> XdsSettings:
    settings = XdsSettings(
        socket_path=workdir / "etc" / "istio" / "proxy" / "XDS",
        discovery_address=address,
        plaintext=True,
        cluster_id="Kubernetes",
    )
    return replace(settings, **changes)


@pytest.fixture
async def istiod() -> AsyncIterator[FakeIstiod]:
    fake = await FakeIstiod().start()
    yield fake
    await fake.stop()


def packed(message: Any) -> any_pb2.Any:
    resource = any_pb2.Any()
    resource.Pack(message)
    return resource


def response(type_url: str, resources: list[any_pb2.Any], *, delta: bool, nonce: str = "n1") -> Any:
    if delta:
        return discovery_pb2.DeltaDiscoveryResponse(
            type_url=type_url,
            nonce=nonce,
            resources=[discovery_pb2.Resource(name=f"r{i}", resource=r) for i, r in enumerate(resources)],
        )
    return discovery_pb2.DiscoveryResponse(
        type_url=type_url, nonce=nonce, version_info="v7", resources=resources
    )


def name_table(host: str = "app.default.svc.cluster.local") -> nds_pb2.NameTable:
    table = nds_pb2.NameTable()
    table.table[host].ips.append("10.0.0.7")
    return table


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sample(proxy: XdsProxy, name: str, **labels: str) -> float:
    registry: Registry = proxy.registry  # type: ignore[attr-defined]
    return registry.sample(PREFIX + name, labels) or 0.0


async def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


# -- relay basics ---------------------------------------------------------------------------------
@FLAVOURS
async def test_basic_flow_cds_then_lds(short_tmp: Path, istiod: FakeIstiod, delta: bool) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        envoy = EnvoyStream(channel, delta=delta)
        cds = await envoy.send(CDS, node=NODE)
        upstream = await istiod.next_stream()
        assert upstream.delta is delta
        assert await upstream.recv() == cds  # forwarded unchanged, node included
        answer = response(CDS, [packed(listener_pb2.Listener(name="x"))], delta=delta)
        await upstream.send(answer)
        assert await envoy.recv() == answer
        lds = await envoy.send(LDS, response_nonce=answer.nonce)
        assert await upstream.recv() == lds
        await upstream.send(response(LDS, [], delta=delta, nonce="n2"))
        assert (await envoy.recv()).type_url == LDS
        assert proxy.active_streams() == 1
        assert sample(proxy, "xds_proxy_connections") == 1
        await envoy.close()
        await wait_until(lambda: proxy.active_streams() == 0)
        assert sample(proxy, "xds_proxy_connections") == 0
    assert sample(proxy, "xds_proxy_requests") == 2
    assert sample(proxy, "xds_proxy_responses") == 2
    assert sample(proxy, "xds_proxy_pushes", type_url=CDS) == 1


async def test_envoy_nacks_and_largest_request_are_measured(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS, error_detail=status_pb2.Status(code=3, message="bad cluster"))
        big = await envoy.send(CDS, resource_names=["c" * 100_000])
        upstream = await istiod.next_stream()
        await upstream.recv()
        await upstream.recv()
        assert sample(proxy, "xds_proxy_nacks", type_url=CDS) == 1
        assert sample(proxy, "pilot_xds_recv_max") >= big.ByteSize()
        await envoy.close()


async def test_only_envoy_and_workload_types_are_forwarded(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await upstream.send(discovery_pb2.DiscoveryResponse(type_url="istio.io/debug/syncz", nonce="d"))
        await upstream.send(
            discovery_pb2.DiscoveryResponse(type_url="type.googleapis.com/istio.other.Thing", nonce="o")
        )
        await upstream.send(discovery_pb2.DiscoveryResponse(type_url=WORKLOAD, nonce="w"))
        await upstream.send(discovery_pb2.DiscoveryResponse(type_url=CDS, nonce="c"))
        assert (await envoy.recv()).nonce == "w"
        assert (await envoy.recv()).nonce == "c"
        await envoy.expect_silence()
        await envoy.close()


# -- agent-owned types ----------------------------------------------------------------------------
@FLAVOURS
async def test_agent_requests_follow_the_first_lds_only(
    short_tmp: Path, istiod: FakeIstiod, delta: bool
) -> None:
    handlers = (NameTableHandler(), ProxyConfigHandler(lambda bundle: None))
    async with running(settings_for(short_tmp, istiod.address), handlers) as (_, channel):
        envoy = EnvoyStream(channel, delta=delta)
        await envoy.send(CDS, node=NODE)
        upstream = await istiod.next_stream()
        assert (await upstream.recv()).type_url == CDS
        await upstream.expect_silence()
        await envoy.send(LDS)
        sent = [await upstream.recv() for _ in range(3)]
        assert [r.type_url for r in sent] == [LDS, NAME_TABLE, PROXY_CONFIG]
        for agent_request in sent[1:]:
            assert not agent_request.HasField("node")
            assert not agent_request.response_nonce
            assert not agent_request.HasField("error_detail")
        await envoy.send(LDS)
        assert (await upstream.recv()).type_url == LDS
        await upstream.expect_silence()
        await envoy.close()


async def test_no_agent_requests_without_handlers(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(LDS)
        upstream = await istiod.next_stream()
        assert (await upstream.recv()).type_url == LDS
        await upstream.expect_silence()
        await envoy.close()


async def _past_first_lds(envoy: EnvoyStream, istiod: FakeIstiod, agent_requests: int) -> FakeUpstreamStream:
    await envoy.send(LDS)
    upstream = await istiod.next_stream()
    for _ in range(1 + agent_requests):
        await upstream.recv()
    return upstream


@FLAVOURS
async def test_name_table_is_handled_acked_and_not_forwarded(
    short_tmp: Path, istiod: FakeIstiod, delta: bool
) -> None:
    seen: list[nds_pb2.NameTable] = []
    nds = NameTableHandler(seen.append)
    async with running(settings_for(short_tmp, istiod.address), (nds,)) as (_, channel):
        envoy = EnvoyStream(channel, delta=delta)
        upstream = await _past_first_lds(envoy, istiod, 1)
        await upstream.send(response(NAME_TABLE, [packed(name_table())], delta=delta, nonce="nds-1"))
        ack = await upstream.recv()
        assert ack.type_url == NAME_TABLE
        assert ack.response_nonce == "nds-1"
        assert not ack.HasField("error_detail")
        if not delta:
            assert ack.version_info == "v7"
        assert nds.ready and nds.table == name_table()
        assert seen == [name_table()]
        # The NameTable never reaches Envoy: the next thing Envoy sees is the CDS push after it.
        await upstream.send(response(CDS, [], delta=delta, nonce="cds-1"))
        assert (await envoy.recv()).nonce == "cds-1"
        await envoy.close()


@FLAVOURS
async def test_bad_agent_payload_is_nacked_with_internal(
    short_tmp: Path, istiod: FakeIstiod, delta: bool
) -> None:
    nds = NameTableHandler()
    bad = any_pb2.Any(type_url=NAME_TABLE, value=b"\x0a\xff\xff")
    async with running(settings_for(short_tmp, istiod.address), (nds,)) as (_, channel):
        envoy = EnvoyStream(channel, delta=delta)
        upstream = await _past_first_lds(envoy, istiod, 1)
        await upstream.send(response(NAME_TABLE, [bad], delta=delta, nonce="bad-1"))
        nack = await upstream.recv()
        assert nack.response_nonce == "bad-1"
        assert nack.error_detail.code == 13
        assert "NameTable" in nack.error_detail.message
        assert not nds.ready
        # The stream carries on.
        await upstream.send(response(CDS, [], delta=delta, nonce="cds-1"))
        assert (await envoy.recv()).nonce == "cds-1"
        await envoy.close()


async def test_empty_agent_response_gets_no_ack(short_tmp: Path, istiod: FakeIstiod) -> None:
    bundles: list[bytes] = []
    handlers = (NameTableHandler(), ProxyConfigHandler(bundles.append))
    _, ca = make_ca("extra-root")
    async with running(settings_for(short_tmp, istiod.address), handlers) as (_, channel):
        envoy = EnvoyStream(channel)
        upstream = await _past_first_lds(envoy, istiod, 2)
        await upstream.send(response(NAME_TABLE, [], delta=False, nonce="empty"))
        config = proxy_config_pb2.ProxyConfig(ca_certificates_pem=[to_pem(ca).decode()])
        await upstream.send(response(PROXY_CONFIG, [packed(config)], delta=False, nonce="pc-1"))
        ack = await upstream.recv()  # the first request after both: the PCDS ACK, no NDS ACK before it
        assert (ack.type_url, ack.response_nonce) == (PROXY_CONFIG, "pc-1")
        assert bundles == [to_pem(ca)]
        await upstream.expect_silence()
        await envoy.close()


# -- upstream headers -----------------------------------------------------------------------------
async def test_upstream_headers(short_tmp: Path, istiod: FakeIstiod) -> None:
    token = short_tmp / "istio-token"
    token.write_text("  header.payload.sig\n")
    settings = settings_for(
        short_tmp, istiod.address, token_path=token, cluster_id="cluster-7", headers={"x-extra": "yes"}
    )
    async with running(settings) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        assert upstream.metadata["authorization"] == "Bearer header.payload.sig"
        assert upstream.metadata["clusterid"] == "cluster-7"
        assert upstream.metadata["x-extra"] == "yes"
        await envoy.close()
        # The token is read again for every stream (the kubelet rotates it in place).
        token.write_text("rotated")
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        assert upstream.metadata["authorization"] == "Bearer rotated"
        await envoy.close()


async def test_missing_token_sends_no_header_and_works(
    short_tmp: Path, istiod: FakeIstiod, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings_for(short_tmp, istiod.address, token_path=short_tmp / "no-such-token")
    caplog.set_level(logging.WARNING)
    async with running(settings) as (_, channel):
        for _ in range(2):
            envoy = EnvoyStream(channel)
            await envoy.send(CDS)
            upstream = await istiod.next_stream()
            assert "authorization" not in upstream.metadata
            assert "clusterid" in upstream.metadata
            await upstream.recv()
            await upstream.send(response(CDS, [], delta=False))
            assert (await envoy.recv()).type_url == CDS
            await envoy.close()
    warnings = [r for r in caplog.records if "no-such-token" in r.getMessage()]
    assert len(warnings) == 1


# -- upstream failures ----------------------------------------------------------------------------
@FLAVOURS
async def test_unreachable_upstream_fails_downstream_promptly(short_tmp: Path, delta: bool) -> None:
    address = f"127.0.0.1:{free_port()}"
    async with running(settings_for(short_tmp, address)) as (proxy, channel):
        envoy = EnvoyStream(channel, delta=delta)
        await envoy.send(CDS)
        code, details = await envoy.status(timeout=3.0)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert address in details and "upstream" in details
        await wait_until(lambda: proxy.active_streams() == 0)
    assert sample(proxy, "istiod_connection_failures") == 1


async def test_reconnect_logging_is_one_line_per_run(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    caplog.set_level(logging.DEBUG, logger="istio.xdsproxy")
    async with running(settings_for(short_tmp, address)) as (_, channel):
        for _ in range(3):
            envoy = EnvoyStream(channel)
            await envoy.send(CDS)
            assert (await envoy.status())[0] == grpc.StatusCode.UNAVAILABLE
        istiod = await FakeIstiod(port=port, auto_reply=True).start()
        try:
            envoy = EnvoyStream(channel)
            await envoy.send(CDS)
            assert (await envoy.recv()).type_url == CDS
            await envoy.close()
        finally:
            await istiod.stop()
    records = [r for r in caplog.records if r.name == "istio.xdsproxy"]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and address in warnings[0].getMessage()
    repeats = [r.getMessage() for r in records if "still cannot connect" in r.getMessage()]
    assert len(repeats) == 2 and all(r.levelno == logging.DEBUG for r in records if "still" in r.getMessage())
    assert "(3 failed attempts)" in repeats[-1]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO and "after" in r.getMessage()]
    assert infos == [f"connected to {address} after 3 failed attempts"]


async def test_wrong_tls_server_name_fails_downstream(short_tmp: Path) -> None:
    ca_key, ca = make_ca("istiod-root")
    server_key = new_key()
    cert = issue(ca_key, ca, dns_sans=["istiod.istio-system.svc"], public_key=server_key.public_key())
    root = short_tmp / "root-cert.pem"
    root.write_bytes(to_pem(ca))
    istiod = await FakeIstiod(tls=(key_to_pem(server_key), to_pem(cert) + to_pem(ca))).start()
    try:
        settings = settings_for(
            short_tmp, istiod.address, plaintext=False, root_ca=root, server_name="wrong.example.com"
        )
        async with running(settings) as (_, channel):
            envoy = EnvoyStream(channel)
            await envoy.send(CDS)
            code, details = await envoy.status()
            assert code == grpc.StatusCode.UNAVAILABLE
            assert "wrong.example.com" in details and istiod.address in details
            assert istiod.all_streams == []  # the handshake failed: istiod never saw the stream
        # With the right name the same upstream works.
        right = replace(settings, server_name="istiod.istio-system.svc")
        async with running(right) as (_, channel):
            envoy = EnvoyStream(channel)
            await envoy.send(CDS)
            upstream = await istiod.next_stream()
            await upstream.recv()
            await upstream.send(response(CDS, [], delta=False))
            assert (await envoy.recv()).type_url == CDS
            await envoy.close()
    finally:
        await istiod.stop()


async def test_missing_root_file_fails_downstream_with_reason(short_tmp: Path, istiod: FakeIstiod) -> None:
    root = short_tmp / "gone-root.pem"
    settings = settings_for(short_tmp, istiod.address, plaintext=False, root_ca=root, server_name="x")
    async with running(settings) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        code, details = await envoy.status()
        assert code == grpc.StatusCode.UNAVAILABLE
        assert str(root) in details and istiod.address in details


@FLAVOURS
async def test_upstream_abort_mid_stream_passes_its_code(
    short_tmp: Path, istiod: FakeIstiod, delta: bool
) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        envoy = EnvoyStream(channel, delta=delta)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await upstream.send(response(CDS, [], delta=delta))
        assert (await envoy.recv()).type_url == CDS
        upstream.abort(grpc.StatusCode.PERMISSION_DENIED, "not allowed any more")
        code, details = await envoy.status()
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "not allowed any more" in details and istiod.address in details
        await wait_until(lambda: proxy.active_streams() == 0)
    assert sample(proxy, "istiod_connection_terminations", type="error") == 1


async def test_upstream_closing_with_ok_ends_downstream_with_ok(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        upstream.close()
        assert await envoy.status() == (grpc.StatusCode.OK, "")


async def test_upstream_going_away_ends_downstream(short_tmp: Path) -> None:
    istiod = await FakeIstiod().start()
    async with running(settings_for(short_tmp, istiod.address)) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await upstream.send(response(CDS, [], delta=False))
        assert (await envoy.recv()).type_url == CDS
        await istiod.stop()  # istiod restarts: the connection drops
        code, details = await envoy.status()
        assert code != grpc.StatusCode.OK
        assert istiod.address in details


# -- concurrency and cancellation -----------------------------------------------------------------
async def test_concurrent_streams_are_independent(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        first = EnvoyStream(channel)
        await first.send(CDS, node=Node(id="first"))
        up_first = await istiod.next_stream()
        assert (await up_first.recv()).node.id == "first"
        second = EnvoyStream(channel, delta=True)
        await second.send(CDS, node=Node(id="second"))
        up_second = await istiod.next_stream()
        assert (await up_second.recv()).node.id == "second"
        await up_first.send(response(CDS, [], delta=False, nonce="to-first"))
        await up_second.send(response(CDS, [], delta=True, nonce="to-second"))
        assert (await first.recv()).nonce == "to-first"
        assert (await second.recv()).nonce == "to-second"
        assert proxy.active_streams() == 2
        await first.close()
        await asyncio.wait_for(up_first.ended.wait(), WAIT)
        await second.send(LDS)
        assert (await up_second.recv()).type_url == LDS
        await up_second.send(response(LDS, [], delta=True, nonce="still-here"))
        assert (await second.recv()).nonce == "still-here"
        assert not up_second.ended.is_set()
        await wait_until(lambda: proxy.active_streams() == 1)
        await second.close()


@FLAVOURS
async def test_downstream_cancel_cancels_upstream(short_tmp: Path, istiod: FakeIstiod, delta: bool) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        envoy = EnvoyStream(channel, delta=delta)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await envoy.close()
        await asyncio.wait_for(upstream.ended.wait(), WAIT)
        assert upstream.cancelled
        await wait_until(lambda: proxy.active_streams() == 0)
    assert sample(proxy, "envoy_connection_terminations", type="cancelled") == 1
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("xds-")]
    assert leftovers == []


async def test_envoy_half_close_is_passed_upstream(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (_, channel):
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await envoy.call.done_writing()
        await asyncio.wait_for(upstream.client_half_closed.wait(), WAIT)
        # Responses istiod still sends reach Envoy, then istiod's OK ends both streams.
        await upstream.send(response(CDS, [], delta=False, nonce="late"))
        assert (await envoy.recv()).nonce == "late"
        upstream.close()
        assert (await envoy.status())[0] == grpc.StatusCode.OK


async def test_oversized_request_fails_only_its_stream(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address, max_recv_bytes=1024)) as (proxy, channel):
        healthy = EnvoyStream(channel)
        await healthy.send(CDS)
        up_healthy = await istiod.next_stream()
        await up_healthy.recv()
        big = EnvoyStream(channel)
        await big.send(CDS, resource_names=["x" * 2000])
        code, _ = await big.status()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        await up_healthy.send(response(CDS, [], delta=False, nonce="ok"))
        assert (await healthy.recv()).nonce == "ok"
        await wait_until(lambda: proxy.active_streams() == 1)
        await healthy.close()


async def test_malformed_request_fails_only_its_stream(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        healthy = EnvoyStream(channel)
        await healthy.send(CDS)
        up_healthy = await istiod.next_stream()
        await up_healthy.recv()
        raw = channel.stream_stream(
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
        )  # no serializers: bytes on the wire as given
        call = raw()
        await call.write(b"\xff\xff\xff\xff not a DiscoveryRequest")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(call.read(), WAIT)
        assert failed.value.code() != grpc.StatusCode.OK
        await up_healthy.send(response(CDS, [], delta=False, nonce="still-fine"))
        assert (await healthy.recv()).nonce == "still-fine"
        await wait_until(lambda: proxy.active_streams() == 1)
        await healthy.close()


async def test_connections_that_do_nothing_are_closed_and_streams_are_kept(
    short_tmp: Path, istiod: FakeIstiod
) -> None:
    limits = uds.ServerLimits(handshake_timeout=0.3, idle_timeout=0.5)
    proxy = XdsProxy(settings_for(short_tmp, istiod.address), limits=limits, registry=Registry())
    await proxy.start()
    channel = grpc.aio.insecure_channel(f"unix:{proxy.socket_path}")
    try:
        path = proxy.socket_path
        silent, idle = await asyncio.gather(silent_client(path, 5), idle_http2_client(path, 5))
        assert silent is not None and silent < 3, (
            "a client that never sent the HTTP/2 preface stayed connected"
        )
        assert idle is not None and idle < 3, "a connection without a call stayed open"
        envoy = EnvoyStream(channel)
        await envoy.send(CDS, node=NODE)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await asyncio.sleep(1)  # a quiet stream is not an idle connection
        await upstream.send(response(CDS, [], delta=False))
        assert (await envoy.recv()).type_url == CDS
        await envoy.close()
    finally:
        await channel.close()
        await proxy.stop()


async def test_stop_ends_streams_and_upstreams(short_tmp: Path, istiod: FakeIstiod) -> None:
    proxy = XdsProxy(settings_for(short_tmp, istiod.address), registry=Registry())
    await proxy.start()
    channel = grpc.aio.insecure_channel(f"unix:{proxy.socket_path}")
    try:
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await proxy.stop()
        assert (await envoy.status())[0] == grpc.StatusCode.OK
        await asyncio.wait_for(upstream.ended.wait(), WAIT)
        assert proxy.active_streams() == 0
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("xds-")] == []
    finally:
        await channel.close()
        await proxy.stop()


# -- health ---------------------------------------------------------------------------------------
@FLAVOURS
async def test_health_is_sent_after_first_lds_and_again_on_new_streams(
    short_tmp: Path, istiod: FakeIstiod, delta: bool
) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        proxy.report_health(False, "readiness probe failed")
        envoy = EnvoyStream(channel, delta=delta)
        await envoy.send(CDS)
        upstream = await istiod.next_stream()
        await upstream.recv()
        await upstream.expect_silence()  # stored, not sent before LDS
        await envoy.send(LDS)
        assert (await upstream.recv()).type_url == LDS
        unhealthy = await upstream.recv()
        assert unhealthy.type_url == HEALTH_INFO
        assert unhealthy.error_detail.code == 13
        assert unhealthy.error_detail.message == "readiness probe failed"
        proxy.report_health(True)
        healthy = await upstream.recv()
        assert healthy.type_url == HEALTH_INFO and not healthy.HasField("error_detail")
        await envoy.close()
        await asyncio.wait_for(upstream.ended.wait(), WAIT)

        again = EnvoyStream(channel, delta=delta)
        await again.send(LDS)
        upstream = await istiod.next_stream()
        assert (await upstream.recv()).type_url == LDS
        resent = await upstream.recv()
        assert resent.type_url == HEALTH_INFO and not resent.HasField("error_detail")
        await again.close()


async def test_health_report_reaches_only_streams_past_lds(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        before_lds = EnvoyStream(channel)
        await before_lds.send(CDS)
        up_before = await istiod.next_stream()
        await up_before.recv()
        after_lds = EnvoyStream(channel)
        await after_lds.send(LDS)
        up_after = await istiod.next_stream()
        await up_after.recv()
        proxy.report_health(False, "down")
        assert (await up_after.recv()).error_detail.message == "down"
        await up_before.expect_silence()
        await before_lds.close()
        await after_lds.close()


# -- the socket -----------------------------------------------------------------------------------
async def test_socket_replaces_stale_file_and_is_world_writable(short_tmp: Path, istiod: FakeIstiod) -> None:
    settings = settings_for(short_tmp, istiod.address)
    settings.socket_path.parent.mkdir(parents=True)
    settings.socket_path.write_text("left behind by a dead agent")
    async with running(settings) as (_, channel):
        mode = settings.socket_path.stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o666
        envoy = EnvoyStream(channel)
        await envoy.send(CDS)
        await istiod.next_stream()
        await envoy.close()


async def test_socket_directory_is_created_0750(short_tmp: Path, istiod: FakeIstiod) -> None:
    settings = settings_for(short_tmp, istiod.address)
    async with running(settings):
        assert stat.S_IMODE(settings.socket_path.parent.stat().st_mode) == 0o750


async def test_unbindable_socket_is_a_clear_error(short_tmp: Path, istiod: FakeIstiod) -> None:
    settings = settings_for(short_tmp, istiod.address, socket_path=short_tmp / "file" / "XDS")
    (short_tmp / "file").write_text("not a directory")
    with pytest.raises(OSError, match="XDS"):
        await XdsProxy(settings, registry=Registry()).start()
