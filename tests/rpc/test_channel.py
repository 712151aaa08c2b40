"""The agent's gRPC client (grpclib underneath) against grpcio's server, our RpcServer and raw peers.

grpcio's server is the independent implementation (as istiod's grpc-go is to Istio's agent); the
raw peer does what no server should (never answer a ping) to show the channel gives up on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from istio_agent import uds
from istio_agent.rpc import Status
from istio_agent.rpc.call import ServerCall
from istio_agent.rpc.channel import Channel, RpcError, parse_target, tls_context
from istio_agent.rpc.server import RpcServer
from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem

CHAT = "/test.Echo/Chat"
ONCE = "/test.Echo/Once"
SERVER_NAME = "istiod.istio-system.svc"


# -- servers ---------------------------------------------------------------------------------------
async def grpcio_chat(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
    """Echoes each message with the caller's x-who; b"fail" ends the call (the client not half-closed)."""
    who = dict(context.invocation_metadata() or ()).get("x-who", "")
    async for message in requests:
        if message == b"fail":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no, thank you")
        if message == b"first":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not like this")
        await context.write(f"{who}|".encode() + message)


async def grpcio_once(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"slow":
        await asyncio.sleep(5)
    if request == b"deny":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "denied")
    return request.upper()


PING_FRIENDLY = [
    # A policy as istiod's (clients may ping down to half its interval), scaled to the tests' pings.
    ("grpc.http2.min_ping_interval_without_data_ms", 50),
    ("grpc.keepalive_permit_without_calls", 1),
]


def grpcio_server() -> grpc.aio.Server:
    server = grpc.aio.server(options=PING_FRIENDLY)
    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Chat": grpc.stream_stream_rpc_method_handler(grpcio_chat),
            "Once": grpc.unary_unary_rpc_method_handler(grpcio_once),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    return server


async def our_chat(call: ServerCall) -> None:
    who = dict(call.metadata()).get("x-who", "")
    async for message in call:
        if message == b"fail":
            await call.abort(Status.PERMISSION_DENIED, "no, thank you")
        await call.send(f"{who}|".encode() + message)


async def our_once(request: bytes, call: ServerCall) -> bytes:
    if request == b"deny":
        await call.abort(Status.PERMISSION_DENIED, "denied")
    return request.upper()


@pytest.fixture
async def grpcio_target() -> AsyncIterator[str]:
    server = grpcio_server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


@pytest.fixture
async def our_target(short_tmp: Path) -> AsyncIterator[str]:
    server = RpcServer(limits=uds.ServerLimits())
    server.add_stream(CHAT, our_chat, bytes, bytes)
    server.add_unary(ONCE, our_once, bytes, bytes)
    path = short_tmp / "rpc.sock"
    await server.start(sock=uds.listen(path, "test server"))
    yield f"unix:{path}"
    await server.stop(None)


@pytest.fixture(params=["grpcio", "our"])
def target(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_target"))


# -- calls -----------------------------------------------------------------------------------------
async def test_unary(target: str) -> None:
    channel = Channel(target)
    try:
        assert await channel.unary(ONCE, b"hello", bytes, timeout=5) == b"HELLO"
        with pytest.raises(RpcError) as failed:
            await channel.unary(ONCE, b"deny", bytes, timeout=5)
        assert (failed.value.code, failed.value.details) == (Status.PERMISSION_DENIED, "denied")
    finally:
        channel.close()


async def test_a_unary_call_past_its_deadline_is_deadline_exceeded(grpcio_target: str) -> None:
    channel = Channel(grpcio_target)
    try:
        with pytest.raises(RpcError) as failed:
            await channel.unary(ONCE, b"slow", bytes, timeout=0.3)
        assert failed.value.code == Status.DEADLINE_EXCEEDED
    finally:
        channel.close()


async def test_bidi_stream_ended_by_the_client(target: str) -> None:
    channel = Channel(target)
    try:
        stream = channel.stream(CHAT, bytes, bytes, metadata=[("clusterid", ""), ("x-who", "envoy")])
        for word in (b"a", b"b", b"c"):
            await stream.send(word)
            assert await stream.recv() == b"envoy|" + word
        await stream.done_writing()
        assert await stream.recv() is None
        assert stream.status == (Status.OK, "")
    finally:
        channel.close()


async def test_a_server_that_ends_the_stream_first_gives_its_status_and_earlier_messages(
    target: str,
) -> None:
    """istiod ends a stream with an error while the agent's side is still open, then resets it."""
    channel = Channel(target)
    try:
        stream = channel.stream(CHAT, bytes, bytes)
        await stream.send(b"a")
        await stream.send(b"fail")
        await asyncio.sleep(0.2)  # the status and the reset arrive before the reader asks
        assert await stream.recv() == b"|a"
        with pytest.raises(RpcError) as failed:
            await stream.recv()
        assert (failed.value.code, failed.value.details) == (Status.PERMISSION_DENIED, "no, thank you")
        assert stream.status == (Status.PERMISSION_DENIED, "no, thank you")
        with pytest.raises(RpcError) as again:
            await stream.send(b"more")
        assert again.value.code == Status.PERMISSION_DENIED
    finally:
        channel.close()


async def test_a_trailers_only_error(grpcio_target: str) -> None:
    channel = Channel(grpcio_target)
    try:
        stream = channel.stream(CHAT, bytes, bytes)
        await stream.send(b"first")  # refused before any response: status in the headers
        with pytest.raises(RpcError) as failed:
            await stream.recv()
        assert (failed.value.code, failed.value.details) == (Status.FAILED_PRECONDITION, "not like this")
    finally:
        channel.close()


async def test_cancel(target: str) -> None:
    channel = Channel(target)
    try:
        stream = channel.stream(CHAT, bytes, bytes)
        await stream.send(b"a")
        assert await stream.recv() == b"|a"
        await stream.cancel()
        assert stream.done() and stream.status is not None
        assert stream.status[0] == Status.CANCELLED
        assert await channel.unary(ONCE, b"still", bytes, timeout=5) == b"STILL"  # the connection lives on
    finally:
        channel.close()


async def test_cancel_wakes_a_reader_waiting_in_another_task(target: str) -> None:
    channel = Channel(target)
    try:
        stream = channel.stream(CHAT, bytes, bytes)
        await stream.send(b"a")
        assert await stream.recv() == b"|a"
        reading = asyncio.create_task(stream.recv())
        await asyncio.sleep(0.1)
        await stream.cancel()
        with pytest.raises(RpcError) as ended:
            await asyncio.wait_for(reading, 2)
        assert ended.value.code == Status.CANCELLED
    finally:
        channel.close()


async def test_an_unreachable_address_is_unavailable() -> None:
    channel = Channel("127.0.0.1:1")
    try:
        with pytest.raises(RpcError) as failed:
            await channel.unary(ONCE, b"x", bytes, timeout=5)
        assert failed.value.code == Status.UNAVAILABLE
        assert "connection refused" in failed.value.details
        stream = channel.stream(CHAT, bytes, bytes)
        with pytest.raises(RpcError) as failed:
            await stream.send(b"x")
        assert failed.value.code == Status.UNAVAILABLE
    finally:
        channel.close()


def test_targets() -> None:
    assert parse_target("istiod.istio-system.svc:15012") == ("istiod.istio-system.svc", 15012, None)
    assert parse_target("[::1]:15012") == ("::1", 15012, None)
    assert parse_target("unix:/etc/istio/proxy/XDS") == (None, None, "/etc/istio/proxy/XDS")
    assert parse_target("unix:///var/run/sds") == (None, None, "/var/run/sds")
    with pytest.raises(ValueError):
        parse_target("istiod")


async def test_ipv6(grpcio_target: str) -> None:
    server = grpcio_server()
    try:
        port = server.add_insecure_port("[::1]:0")
    except RuntimeError:
        pytest.skip("no IPv6 loopback")
    await server.start()
    channel = Channel(f"[::1]:{port}")
    try:
        assert await channel.unary(ONCE, b"six", bytes, timeout=5) == b"SIX"
    finally:
        channel.close()
        await server.stop(None)


# -- TLS -------------------------------------------------------------------------------------------
class Pki:
    """A CA, istiod's serving certificate (SERVER_NAME) and a client's certificate on disk."""

    def __init__(self, directory: Path) -> None:
        ca_key, ca = make_ca("test root")
        self.root = to_pem(ca)
        server_key = new_key()
        server = issue(ca_key, ca, public_key=server_key.public_key(), dns_sans=[SERVER_NAME])
        self.server_pair = (key_to_pem(server_key), to_pem(server))
        client_key = new_key()
        client = issue(
            ca_key, ca, public_key=client_key.public_key(), uri_sans=["spiffe://cluster.local/ns/a/sa/b"]
        )
        self.client_chain = directory / "cert-chain.pem"
        self.client_key = directory / "key.pem"
        self.client_chain.write_bytes(to_pem(client) + self.root)
        self.client_key.write_bytes(key_to_pem(client_key))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


async def tls_server(pki: Pki, *, require_client_cert: bool) -> tuple[grpc.aio.Server, int]:
    server = grpcio_server()
    credentials = grpc.ssl_server_credentials(
        [pki.server_pair], root_certificates=pki.root, require_client_auth=require_client_cert
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


async def call_once(channel: Channel) -> bytes:
    try:
        result: bytes = await channel.unary(ONCE, b"tls", bytes, timeout=5)
        return result
    finally:
        channel.close()


async def test_tls_with_server_name_override(pki: Pki) -> None:
    server, port = await tls_server(pki, require_client_cert=False)
    try:
        context = tls_context(pki.root)
        assert (
            await call_once(Channel(f"127.0.0.1:{port}", ssl_context=context, server_name=SERVER_NAME))
            == b"TLS"
        )
        with pytest.raises(RpcError) as wrong_name:  # the certificate is not for 127.0.0.1
            await call_once(Channel(f"127.0.0.1:{port}", ssl_context=tls_context(pki.root)))
        assert wrong_name.value.code == Status.UNAVAILABLE
        assert "CERTIFICATE_VERIFY_FAILED" in wrong_name.value.details
        with pytest.raises(RpcError) as wrong_root:
            other = tls_context(to_pem(make_ca("another root")[1]))
            await call_once(Channel(f"127.0.0.1:{port}", ssl_context=other, server_name=SERVER_NAME))
        assert wrong_root.value.code == Status.UNAVAILABLE
        assert "CERTIFICATE_VERIFY_FAILED" in wrong_root.value.details
    finally:
        await server.stop(None)


async def test_tls_with_a_client_certificate(pki: Pki) -> None:
    server, port = await tls_server(pki, require_client_cert=True)
    target = f"127.0.0.1:{port}"
    try:
        with_cert = tls_context(pki.root, (str(pki.client_chain), str(pki.client_key)))
        assert await call_once(Channel(target, ssl_context=with_cert, server_name=SERVER_NAME)) == b"TLS"
        with pytest.raises(RpcError) as refused:
            await call_once(Channel(target, ssl_context=tls_context(pki.root), server_name=SERVER_NAME))
        assert refused.value.code == Status.UNAVAILABLE
    finally:
        await server.stop(None)


# -- keepalive -------------------------------------------------------------------------------------
async def test_keepalive_pings_are_answered_and_the_stream_stays(target: str) -> None:
    channel = Channel(target, keepalive_time=0.1, keepalive_timeout=0.3)
    try:
        stream = channel.stream(CHAT, bytes, bytes)
        await stream.send(b"a")
        assert await stream.recv() == b"|a"
        protocol = channel._channel._protocol
        assert protocol is not None
        await asyncio.sleep(1.0)  # ten pings, no data
        assert protocol.connection.last_ping_sent is not None
        await stream.send(b"b")
        assert await stream.recv() == b"|b"
    finally:
        channel.close()


class SilentServer:
    """Answers the HTTP/2 handshake and a call's headers, then stops reading: pings go unanswered."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        import h2.config
        import h2.connection
        import h2.events

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            writer.write(conn.data_to_send())
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        conn.send_headers(
                            event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                        )
                        writer.write(conn.data_to_send())
                        await asyncio.sleep(30)  # deaf from now on
                writer.write(conn.data_to_send())

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_a_server_that_never_answers_pings_loses_the_channel() -> None:
    silent = SilentServer()
    port = await silent.start()
    channel = Channel(f"127.0.0.1:{port}", keepalive_time=0.1, keepalive_timeout=0.3)
    try:
        stream = channel.stream(CHAT, bytes, bytes)
        await stream.send(b"a")
        started = asyncio.get_running_loop().time()
        with pytest.raises(RpcError) as lost:
            await asyncio.wait_for(stream.recv(), 3)
        assert lost.value.code == Status.UNAVAILABLE
        assert asyncio.get_running_loop().time() - started < 2
    finally:
        channel.close()
        await silent.stop()
