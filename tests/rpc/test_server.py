"""The agent's gRPC server (grpclib underneath) against grpcio's client and raw HTTP/2 peers.

grpcio is the client real applications and tools use; the raw peers do what no well-behaved
client does (say nothing, ping too often, never answer a ping) to show each limit holds.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from istio_agent import uds
from istio_agent.rpc import Status
from istio_agent.rpc.call import ServerCall
from istio_agent.rpc.server import RpcServer
from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem

CHAT = "/test.Echo/Chat"
ONCE = "/test.Echo/Once"


def identity(data: bytes) -> bytes:
    return data


async def echo(call: ServerCall) -> None:
    """Each message back, prefixed with what the handler saw of the call."""
    metadata = dict(call.metadata())
    async for message in call:
        if message == b"fail":
            await call.abort(Status.PERMISSION_DENIED, "no, thank you")
        await call.send(f"{call.peer()}|{metadata.get('x-who', '')}|".encode() + message)


async def once(request: bytes, call: ServerCall) -> bytes:
    return request.upper()


@pytest.fixture
def socket_path(short_tmp: Path) -> Path:
    return short_tmp / "rpc.sock"


@pytest.fixture
async def serving(socket_path: Path) -> AsyncIterator[RpcServer]:
    server = echo_server(uds.ServerLimits(handshake_timeout=0.3, idle_timeout=0.6, keepalive_time=0.4))
    await server.start(sock=uds.listen(socket_path, "test server"))
    yield server
    await server.stop(None)


def echo_server(limits: uds.ServerLimits, **options: Any) -> RpcServer:
    server = RpcServer(limits=limits, **options)
    server.add_stream(CHAT, echo, bytes, bytes)
    server.add_unary(ONCE, once, bytes, bytes)
    return server


def chat(channel: grpc.aio.Channel) -> Any:
    return channel.stream_stream(CHAT, request_serializer=identity, response_deserializer=identity)


async def test_a_client_that_connected_before_the_server_started_is_served(socket_path: Path) -> None:
    listener = uds.listen(socket_path, "test server")
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        call = chat(channel)(metadata=(("x-who", "envoy"),))
        writing = asyncio.create_task(call.write(b"hello"))
        await asyncio.sleep(0.3)  # the connection waits in the kernel's queue
        assert not writing.done()
        server = echo_server(uds.ServerLimits())
        await server.start(sock=listener)
        try:
            await writing
            assert await call.read() == b"unix:|envoy|hello"
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
        finally:
            await server.stop(None)


async def test_unary_call(serving: RpcServer, socket_path: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        unary = channel.unary_unary(ONCE, request_serializer=identity, response_deserializer=identity)
        assert await unary(b"abc") == b"ABC"


async def test_abort_reaches_the_client_with_code_and_details(serving: RpcServer, socket_path: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        call = chat(channel)()
        await call.write(b"fail")
        assert await call.code() == grpc.StatusCode.PERMISSION_DENIED
        assert await call.details() == "no, thank you"


async def test_a_message_over_the_maximum_is_refused_before_it_is_read(socket_path: Path) -> None:
    server = echo_server(uds.ServerLimits(), max_receive_bytes=1024)
    await server.start(sock=uds.listen(socket_path, "test server"))
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            call = chat(channel)()
            await call.write(b"x" * 1024)
            assert (await call.read()).endswith(b"|" + b"x" * 1024)
            await call.write(b"x" * 1025)
            assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1025 vs. 1024" in (await call.details() or "")
    finally:
        await server.stop(None)


async def test_an_unknown_method_is_unimplemented(serving: RpcServer, socket_path: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        unary = channel.unary_unary(
            "/test.Echo/Nope", request_serializer=identity, response_deserializer=identity
        )
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await unary(b"x")
        assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- raw HTTP/2 peers -----------------------------------------------------------------------------


class RawPeer:
    """An HTTP/2 client that only does what the test tells it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    async def connect(self, *, handshake: bool = True) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(str(self.path))
        if handshake:
            self.h2.initiate_connection()
            await self.flush()

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    async def events(self, timeout: float, *, answer: bool = True) -> Sequence[Any] | None:
        """The events of the next read, or None when the server closed the connection.

        ``answer``: send what h2 answers (SETTINGS and ping acknowledgements); a write to a closed
        socket would make the reader drop what it still holds, so a peer waiting for the end does not.
        """
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except ConnectionError:
            return None
        if not data:
            return None
        events = self.h2.receive_data(data)
        if answer:
            await self.flush()
        return events

    async def until_closed(self, timeout: float) -> list[Any]:
        """Every event until the server closes the connection."""
        seen: list[Any] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (events := await self.events(deadline - loop.time(), answer=False)) is not None:
            seen.extend(events)
        return seen

    def close(self) -> None:
        self.writer.close()


def goaway(events: Sequence[Any]) -> h2.events.ConnectionTerminated | None:
    return next((e for e in events if isinstance(e, h2.events.ConnectionTerminated)), None)


async def test_a_client_that_never_sends_the_preface_is_closed(serving: RpcServer, socket_path: Path) -> None:
    peer = RawPeer(socket_path)
    await peer.connect(handshake=False)
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(peer.reader.read(), 3) is not None  # EOF (after the server's SETTINGS)
    assert asyncio.get_running_loop().time() - started < 2
    peer.close()


async def test_a_connection_without_calls_gets_goaway(serving: RpcServer, socket_path: Path) -> None:
    peer = RawPeer(socket_path)
    await peer.connect()
    terminated = goaway(await peer.until_closed(3))
    assert terminated is not None and terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
    peer.close()


async def test_pings_at_half_the_interval_are_welcome_faster_ones_get_too_many_pings(
    socket_path: Path,
) -> None:
    server = echo_server(uds.ServerLimits(keepalive_time=0.4))
    await server.start(sock=uds.listen(socket_path, "test server"))
    try:
        await pinging(socket_path)
    finally:
        await server.stop(None)


async def pinging(socket_path: Path) -> None:
    polite = RawPeer(socket_path)
    await polite.connect()
    for _ in range(4):  # keepalive_time 0.4 s: pings every 0.25 s are allowed
        polite.h2.ping(b"12345678")
        await polite.flush()
        assert await polite.events(1) is not None
        await asyncio.sleep(0.25)
    polite.close()

    rude = RawPeer(socket_path)
    await rude.connect()
    for _ in range(4):
        rude.h2.ping(b"12345678")
    await rude.flush()
    terminated = goaway(await rude.until_closed(3))
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert terminated.additional_data == b"too_many_pings"
    rude.close()


async def test_a_client_that_stops_answering_pings_is_closed(socket_path: Path) -> None:
    server = echo_server(uds.ServerLimits(keepalive_time=0.2, keepalive_timeout=0.3))
    await server.start(sock=uds.listen(socket_path, "test server"))
    try:
        peer = RawPeer(socket_path)
        await peer.connect()
        started = asyncio.get_running_loop().time()
        while await asyncio.wait_for(peer.reader.read(65536), 3):  # read, never answer
            pass
        assert asyncio.get_running_loop().time() - started < 2
        peer.close()
    finally:
        await server.stop(None)


async def test_max_concurrent_streams_is_announced(socket_path: Path) -> None:
    server = echo_server(uds.ServerLimits(), max_concurrent_streams=100000)
    await server.start(sock=uds.listen(socket_path, "test server"))
    try:
        peer = RawPeer(socket_path)
        await peer.connect()
        settings: dict[int, int] = {}
        while h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS not in settings:
            for event in await peer.events(2) or ():
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    settings.update({code: c.new_value for code, c in event.changed_settings.items()})
        assert settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 100000
        peer.close()
    finally:
        await server.stop(None)


async def test_stop_cancels_calls_after_the_grace(serving: RpcServer, socket_path: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        call = chat(channel)()
        await call.write(b"a")
        await call.read()
        await serving.stop(0.1)
        assert await call.code() in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNKNOWN,
        )


async def test_a_connection_accepted_elsewhere_is_adopted_with_its_first_bytes() -> None:
    """One port, two protocols: the acceptor reads the first bytes, then hands gRPC connections over."""
    server = echo_server(uds.ServerLimits())
    await server.start_unbound()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.readexactly(4)
        assert first == b"PRI "
        buffered = bytes(reader._buffer)  # what the stream reader already holds goes along
        server.adopt(writer.transport, first + buffered)  # type: ignore[arg-type]

    acceptor = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = acceptor.sockets[0].getsockname()[1]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = chat(channel)(metadata=(("x-who", "istioctl"),))
            await call.write(b"hi")
            assert (await call.read()).endswith(b"|istioctl|hi")
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
    finally:
        acceptor.close()
        await server.stop(None)


def server_tls(directory: Path) -> ssl.SSLContext:
    """A server's TLS context with a certificate from a throwaway CA."""
    ca_key, ca = make_ca()
    key = new_key()
    pem = directory / "server.pem"
    pem.write_bytes(key_to_pem(key) + to_pem(issue(ca_key, ca, public_key=key.public_key(), dns_sans=["x"])))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem)
    return context


async def test_a_tls_handshake_that_fails_leaves_nothing_behind(tmp_path: Path) -> None:
    """asyncio creates the protocol before the TLS handshake and tells it nothing when that fails:
    such a connection never was one, and stopping the server must not trip over it."""
    context = server_tls(tmp_path)
    server = echo_server(uds.ServerLimits())
    await server.start(host="127.0.0.1", port=0, ssl_context=context)
    port = server.sockets()[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # plaintext HTTP/2 to a TLS port
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the handshake failed: closed
    writer.close()
    await server.stop(0)


async def test_the_handshake_deadline_covers_the_tls_handshake(tmp_path: Path) -> None:
    """A client that connects to the TLS port and says nothing is closed after ``handshake_timeout``
    (asyncio alone would wait a minute for its ClientHello)."""
    context = server_tls(tmp_path)
    server = echo_server(uds.ServerLimits(handshake_timeout=0.3))
    await server.start(host="127.0.0.1", port=0, ssl_context=context)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets()[0].getsockname()[1])
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()
    finally:
        await server.stop(0)


async def test_the_server_pings_every_keepalive_interval(socket_path: Path) -> None:
    server = echo_server(uds.ServerLimits(keepalive_time=0.2, keepalive_timeout=5))
    await server.start(sock=uds.listen(socket_path, "test server"))
    try:
        peer = RawPeer(socket_path)
        await peer.connect()
        pings = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.5
        while loop.time() < deadline:
            try:
                events = await peer.events(deadline - loop.time())
            except TimeoutError:
                break
            pings += sum(isinstance(event, h2.events.PingReceived) for event in events or ())
        assert pings >= 3, f"{pings} pings in 1.5 s at a 0.2 s interval"
        peer.close()
    finally:
        await server.stop(None)
