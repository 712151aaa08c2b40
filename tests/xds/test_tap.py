"""The debug tap on a real port: gRPC and HTTP questions relayed on Envoy's own upstream stream.

Between a real gRPC client (Envoy) on the xDS proxy's socket and a scriptable fake istiod on
loopback: what istiod receives, what the asker gets back, and the clear errors when there is no
stream to istiod, istiod stays silent, or the type is not a debug type.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import ControlPlane
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.status.v3 import csds_pb2
from google.protobuf import any_pb2

from istio_agent import uds
from istio_agent.http.client import fetch as http_request
from istio_agent.xds import tap as tap_module
from istio_agent.xds.proxy import XdsProxy
from istio_agent.xds.tap import DebugTap, TapStartError
from tests.xds import CDS, EnvoyStream, FakeIstiod, FakeUpstreamStream, running
from tests.xds.test_proxy import settings_for

SYNCZ = "istio.io/debug/syncz"
FLAVOURS = pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])


def syncz_answer(request: Any, *, delta: bool) -> Any:
    config = csds_pb2.ClientConfig()
    config.node.id = "app-1.default"
    packed = any_pb2.Any()
    packed.Pack(config)
    control_plane = ControlPlane(identifier='{"Component":"istiod","ID":"istiod-1"}')
    if delta:
        return discovery_pb2.DeltaDiscoveryResponse(
            type_url=request.type_url,
            nonce="d1",
            system_version_info="v3",
            resources=[discovery_pb2.Resource(resource=packed)],
            control_plane=control_plane,
        )
    return discovery_pb2.DiscoveryResponse(
        type_url=request.type_url,
        nonce="d1",
        version_info="v3",
        resources=[packed],
        control_plane=control_plane,
    )


@pytest.fixture
async def istiod() -> AsyncIterator[FakeIstiod]:
    fake = await FakeIstiod().start()
    yield fake
    await fake.stop()


@pytest.fixture
async def tapped(short_tmp: Path, istiod: FakeIstiod) -> AsyncIterator[tuple[XdsProxy, DebugTap, Any]]:
    """A proxy with a tap on an ephemeral localhost port, and Envoy's channel to the proxy."""
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        tap = DebugTap(proxy, 0, host="127.0.0.1", grpc_timeout=1.0, http_timeout=1.0)
        await tap.start()
        try:
            yield proxy, tap, channel
        finally:
            await tap.stop()


async def envoy_connected(
    channel: grpc.aio.Channel, istiod: FakeIstiod, *, delta: bool
) -> FakeUpstreamStream:
    envoy = EnvoyStream(channel, delta=delta)
    await envoy.send(CDS)
    upstream = await istiod.next_stream()
    await upstream.recv()
    return upstream


async def ask_grpc(port: int, type_url: str, names: list[str] | None = None) -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        await call.write(discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names or []))
        try:
            return await asyncio.wait_for(call.read(), 5)
        finally:
            call.cancel()


@FLAVOURS
async def test_grpc_question_goes_up_envoys_stream_and_istiods_answer_comes_back(
    tapped: Any, istiod: FakeIstiod, delta: bool
) -> None:
    _, tap, channel = tapped
    upstream = await envoy_connected(channel, istiod, delta=delta)
    asking = asyncio.create_task(ask_grpc(tap.port, SYNCZ))
    question = await upstream.recv()
    assert question.type_url == SYNCZ and not question.HasField("node")  # on the workload's stream
    await upstream.send(syncz_answer(question, delta=delta))
    answer = await asking
    assert answer.type_url == SYNCZ and answer.version_info == "v3"
    assert json.loads(answer.control_plane.identifier)["ID"] == "istiod-1"  # who answered is kept
    config = csds_pb2.ClientConfig()
    answer.resources[0].Unpack(config)
    assert config.node.id == "app-1.default"
    await upstream.expect_silence()  # the debug answer is not ACKed, as in Istio


async def test_http_get_debug_path_answers_protobuf_json(tapped: Any, istiod: FakeIstiod) -> None:
    _, tap, channel = tapped
    upstream = await envoy_connected(channel, istiod, delta=False)
    asking = asyncio.create_task(
        http_request("GET", f"http://127.0.0.1:{tap.port}/debug/config_dump?resourceName=app-1.default")
    )
    question = await upstream.recv()
    assert question.type_url == "istio.io/debug/config_dump"
    assert list(question.resource_names) == ["app-1.default"]
    await upstream.send(syncz_answer(question, delta=False))
    reply = await asking
    assert reply.status == 200 and reply.headers.get("content-type") == "application/json"
    body = json.loads(reply.body)
    assert body["typeUrl"] == "istio.io/debug/config_dump"
    assert body["resources"][0]["node"]["id"] == "app-1.default"  # rendered, not base64


async def test_no_stream_to_istiod_is_a_clear_error(tapped: Any) -> None:
    _, tap, _ = tapped
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await ask_grpc(tap.port, SYNCZ)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failed.value.details() == "proxy not connected to Istiod"
    reply = await http_request("GET", f"http://127.0.0.1:{tap.port}/debug/syncz")
    assert reply.status == 503 and b"proxy not connected to Istiod" in reply.body


async def test_istiod_that_never_answers_gives_a_timeout_error_not_a_hang(
    tapped: Any, istiod: FakeIstiod
) -> None:
    _, tap, channel = tapped
    upstream = await envoy_connected(channel, istiod, delta=False)
    started = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await ask_grpc(tap.port, "istio.io/debug/nonsense")
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.details() == "istiod did not answer istio.io/debug/nonsense within 1s"
    assert asyncio.get_running_loop().time() - started < 3
    assert (await upstream.recv()).type_url == "istio.io/debug/nonsense"

    reply = await http_request("GET", f"http://127.0.0.1:{tap.port}/debug/nonsense")
    assert reply.status == 504 and b"did not answer istio.io/debug/nonsense within 1s" in reply.body

    # A late answer is dropped; the next question gets its own.
    await upstream.send(syncz_answer(await upstream.recv(), delta=False))
    asking = asyncio.create_task(ask_grpc(tap.port, SYNCZ))
    question = await upstream.recv()
    await upstream.send(syncz_answer(question, delta=False))
    assert (await asking).type_url == SYNCZ


async def test_not_a_debug_type_and_bad_http_requests_are_refused(tapped: Any) -> None:
    _, tap, _ = tapped
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await ask_grpc(tap.port, CDS)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "answers only istio.io/debug/* types" in (failed.value.details() or "")
    base = f"http://127.0.0.1:{tap.port}"
    assert (await http_request("GET", f"{base}/stats")).status == 404
    assert (await http_request("POST", f"{base}/debug/syncz")).status == 405
    assert (await http_request("GET", f"{base}/debug/syncz?a=%zz&&b")).status == 400


async def test_port_in_use_is_a_clear_start_error(tapped: Any) -> None:
    proxy, tap, _ = tapped
    second = DebugTap(proxy, tap.port, host="127.0.0.1")
    with pytest.raises(TapStartError, match=f"failed to start istio tap server on 127.0.0.1:{tap.port}"):
        await second.start()


async def test_stop_with_idle_connections_open_logs_no_error(
    short_tmp: Path, istiod: FakeIstiod, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, _):
        tap = DebugTap(proxy, 0, host="127.0.0.1")
        await tap.start()
        _, silent = await asyncio.open_connection("127.0.0.1", tap.port)  # says nothing yet
        _, http = await asyncio.open_connection("127.0.0.1", tap.port)
        http.write(b"GET /debug/syncz HTTP/1.1\r\n")  # an unfinished request head
        await asyncio.sleep(0.1)
        await tap.stop()
        silent.close()
        http.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# -- what a hostile asker can cost (issue 20) -----------------------------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_request_followed_by_a_stream_of_bytes_is_held_back_by_tcp(
    short_tmp: Path, istiod: FakeIstiod
) -> None:
    """The tap read the socket into memory without limit while the question waited on istiod."""
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        tap = DebugTap(proxy, 0, host="127.0.0.1", http_timeout=10.0)
        await tap.start()
        try:
            await envoy_connected(channel, istiod, delta=False)  # so the question waits on istiod
            _, writer = await asyncio.open_connection("127.0.0.1", tap.port)
            writer.write(b"GET /debug/nonexistent HTTP/1.1\r\nHost: localhost:15004\r\n\r\n")
            chunk, sent = b"x" * 65536, 0
            try:
                async with asyncio.timeout(2):
                    while sent < 512 * 2**20:
                        writer.write(chunk)
                        await writer.drain()
                        sent += len(chunk)
            except TimeoutError:
                pass
            finally:
                writer.close()
            assert sent < 32 * 2**20, f"the tap took {sent >> 20} MiB it had not asked for"
        finally:
            await tap.stop()


async def test_connections_are_bounded_and_the_tap_stays_usable(tapped: Any) -> None:
    """~6,700 connections that sent only ``PRI `` took every descriptor of the agent."""
    _, tap, _ = tapped
    before = open_descriptors()
    held = []
    for _ in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
        writer.write(b"PRI ")
        held.append((reader, writer))
    await asyncio.sleep(0.5)
    try:
        grown = open_descriptors() - before
        # 200 are the test's; the tap holds at most 64, one descriptor each (no relay behind them)
        assert grown <= 200 + 64 + 16, f"{grown} descriptors for 200 connections"
        reply = await http_request("GET", f"http://127.0.0.1:{tap.port}/debug/syncz")
        assert reply.status == 503  # answered (no stream to istiod here), not refused
    finally:
        for _, writer in held:
            writer.close()


@pytest.mark.both_loops
async def test_askers_hanging_up_on_http2_connections_log_no_error(
    tapped: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Each closed HTTP/2 connection logged a 17-line "Unhandled exception in client_connected_cb"."""
    _, tap, _ = tapped
    for _ in range(30):
        reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
        writer.write(H2_PREFACE)
        await asyncio.wait_for(reader.read(9), 5)  # the server's SETTINGS: the relay is up
        writer.transport.abort()  # a reset, as a client killed mid-connection
        reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
        writer.write(H2_PREFACE)
        await asyncio.wait_for(reader.read(9), 5)
        writer.close()
    await asyncio.sleep(0.5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, caplog.text


# -- one port, no relay behind it (issue 23) ------------------------------------------------------------


def _tcp_sockets() -> dict[str, tuple[str, int, int]]:
    """This process's TCP sockets: inode -> (state, local port, remote port), from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    local = int(fields[1].rpartition(":")[2], 16)
                    remote = int(fields[2].rpartition(":")[2], 16)
                    found[fields[9]] = (fields[3], local, remote)
    return found


def _listening(sockets: dict[str, tuple[str, int, int]]) -> set[int]:
    return {local for state, local, _ in sockets.values() if state == "0A"}  # 0A: LISTEN


async def test_a_grpc_asker_is_served_on_its_own_connection_with_no_loopback_relay(
    short_tmp: Path, istiod: FakeIstiod
) -> None:
    """The tap spliced gRPC connections to a grpc server of its own on a loopback port."""
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, channel):
        before = _tcp_sockets()
        tap = DebugTap(proxy, 0, host="127.0.0.1", grpc_timeout=5.0)
        await tap.start()
        try:
            assert _listening(_tcp_sockets()) - _listening(before) == {tap.port}
            upstream = await envoy_connected(channel, istiod, delta=False)
            idle = _tcp_sockets()
            asking = asyncio.create_task(ask_grpc(tap.port, SYNCZ))
            question = await upstream.recv()  # the asker is being served now
            opened = [s for inode, s in _tcp_sockets().items() if inode not in idle]
            asker = [s for s in opened if s[2] == tap.port]
            assert len(asker) == 1 and asker[0][0] == "01"  # the asker's end (01: ESTABLISHED)
            assert sorted(opened) == sorted([asker[0], ("01", tap.port, asker[0][1])])  # the tap's, no more
            await upstream.send(syncz_answer(question, delta=False))
            assert (await asking).type_url == SYNCZ
        finally:
            await tap.stop()


def test_the_tap_does_not_use_grpcio() -> None:
    tree = ast.parse(Path(tap_module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imported if name == "grpc" or name.startswith("grpc.")]


async def test_a_connection_that_says_nothing_is_closed_after_the_first_bytes_timeout(
    tapped: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tap_module, "FIRST_BYTES_TIMEOUT", 0.3)
    _, tap, _ = tapped
    reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
    writer.write(b"PR")  # not enough to tell the protocol
    try:
        assert await asyncio.wait_for(reader.read(), 3) == b""
    finally:
        writer.close()


@pytest.mark.both_loops
async def test_grpc_connections_that_never_finish_their_handshake_or_stay_idle_are_closed(
    short_tmp: Path, istiod: FakeIstiod
) -> None:
    limits = uds.ServerLimits(handshake_timeout=0.3, idle_timeout=0.4)
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, _):
        tap = DebugTap(proxy, 0, host="127.0.0.1", limits=limits)
        await tap.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
            writer.write(b"PRI * HTTP/2.0\r\n")  # a preface cut short, no SETTINGS
            received = await asyncio.wait_for(reader.read(), 3)  # the server's SETTINGS, then closed
            assert b"max_idle" not in received
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
            writer.write(H2_PREFACE)  # handshaken, then no call
            received = await asyncio.wait_for(reader.read(), 3)  # SETTINGS, ack, then GOAWAY and close
            assert b"max_idle" in received
            writer.close()
        finally:
            await tap.stop()


@pytest.mark.both_loops
async def test_the_quietest_connection_makes_room_grpc_or_http(short_tmp: Path, istiod: FakeIstiod) -> None:
    async with running(settings_for(short_tmp, istiod.address)) as (proxy, _):
        tap = DebugTap(proxy, 0, host="127.0.0.1", max_connections=2)
        await tap.start()
        try:
            quiet_reader, quiet = await asyncio.open_connection("127.0.0.1", tap.port)
            quiet.write(H2_PREFACE)
            await asyncio.wait_for(quiet_reader.read(9), 5)
            await asyncio.sleep(0.05)
            busy_reader, busy = await asyncio.open_connection("127.0.0.1", tap.port)
            busy.write(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(busy_reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 404")
            _, third = await asyncio.open_connection("127.0.0.1", tap.port)
            third.write(b"GET ")
            rest = await asyncio.wait_for(quiet_reader.read(), 3)  # the gRPC one, quiet the longest
            assert not rest.endswith(b"max_idle")  # dropped, not idled out
            assert not busy.is_closing()
            busy.write(b"GET /debug/syncz HTTP/1.1\r\nHost: x\r\n\r\n")  # still served
            assert await asyncio.wait_for(busy_reader.read(1), 5)
            for writer in (quiet, busy, third):
                writer.close()
        finally:
            await tap.stop()
