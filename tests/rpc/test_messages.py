"""Large messages through the agent's gRPC layer: whole, refused when too large, flow-controlled, and
held once (issue 23, "the relay holds a push once").

grpcio is the independent peer for the round trips; raw h2 peers announce lengths they never send
and keep windows tiny, which no gRPC library would do on request.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest

from istio_agent import uds
from istio_agent.rpc import Status
from istio_agent.rpc.call import ServerCall
from istio_agent.rpc.channel import DEFAULT_MAX_RECEIVE_BYTES, Channel, RpcError
from istio_agent.rpc.server import RpcServer

ECHO = "/test.Big/Echo"
GIVE = "/test.Big/Give"
MiB = 1024 * 1024
LARGE = 32 * MiB  # the maximum both sides accept in the round trips


def payload(size: int) -> bytes:
    """Not one repeated byte, so a misplaced chunk shows."""
    block = os.urandom(64 * 1024)
    return (block * (size // len(block) + 1))[:size]


def identity(data: bytes) -> bytes:
    return data


async def echo(call: ServerCall) -> None:
    async for message in call:
        await call.send(message)


# -- servers ---------------------------------------------------------------------------------------
@pytest.fixture
async def our_server(short_tmp: Path) -> AsyncIterator[str]:
    server = RpcServer(limits=uds.ServerLimits(), max_receive_bytes=LARGE)
    server.add_stream(ECHO, echo, bytearray, bytes)
    path = short_tmp / "big.sock"
    await server.start(sock=uds.listen(path, "test server"))
    yield f"unix:{path}"
    await server.stop(None)


async def _grpcio_echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
    async for message in requests:
        await context.write(message)


@pytest.fixture
async def grpcio_server() -> AsyncIterator[str]:
    options = [("grpc.max_receive_message_length", LARGE), ("grpc.max_send_message_length", LARGE)]
    server = grpc.aio.server(options=options)
    handler = grpc.method_handlers_generic_handler(
        "test.Big", {"Echo": grpc.stream_stream_rpc_method_handler(_grpcio_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


# -- whole, each way -------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [5 * MiB, 20 * MiB])
async def test_grpcio_client_to_our_server_and_back(our_server: str, size: int) -> None:
    """Our server receives and sends a message of many DATA frames (grpcio's are 16 KiB)."""
    message = payload(size)
    options = [("grpc.max_receive_message_length", LARGE), ("grpc.max_send_message_length", LARGE)]
    async with grpc.aio.insecure_channel(our_server, options=options) as channel:
        call = channel.stream_stream(ECHO, request_serializer=identity, response_deserializer=identity)()
        await call.write(message)
        echoed = await asyncio.wait_for(call.read(), 30)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    assert len(echoed) == size and echoed == message


@pytest.mark.parametrize("size", [5 * MiB, 20 * MiB])
@pytest.mark.parametrize("response_type", [bytes, bytearray])
async def test_our_client_to_grpcio_server_and_back(
    grpcio_server: str, size: int, response_type: type
) -> None:
    message = payload(size)
    channel = Channel(grpcio_server, max_receive_bytes=LARGE)
    try:
        stream = channel.stream(ECHO, bytes, response_type)
        await stream.send(message)
        echoed = await asyncio.wait_for(stream.recv(), 30)
        await stream.done_writing()
        assert await stream.recv() is None
    finally:
        channel.close()
    assert type(echoed) is response_type
    assert len(echoed) == size and echoed == message


async def test_our_client_to_our_server_and_back(our_server: str) -> None:
    message = payload(20 * MiB)
    channel = Channel(our_server, max_receive_bytes=LARGE)
    try:
        stream = channel.stream(ECHO, bytes, bytearray)
        for _ in range(2):  # the second message starts where the first ended
            await stream.send(memoryview(message))
            echoed = await asyncio.wait_for(stream.recv(), 30)
            assert echoed == message
        await stream.done_writing()
        assert await stream.recv() is None
        assert stream.status == (Status.OK, "")
    finally:
        channel.close()


async def test_empty_and_small_messages_between_large_ones(our_server: str) -> None:
    channel = Channel(our_server, max_receive_bytes=LARGE)
    try:
        stream = channel.stream(ECHO, bytes, bytes)
        for message in (b"", b"a", payload(MiB + 3), b"", b"xyz"):
            await stream.send(message)
            assert await asyncio.wait_for(stream.recv(), 10) == message
        await stream.done_writing()
        assert await stream.recv() is None
    finally:
        channel.close()


# -- the client's maximum --------------------------------------------------------------------------
async def test_the_client_refuses_a_response_over_its_maximum_as_grpc_does(grpcio_server: str) -> None:
    assert (
        4 * MiB == DEFAULT_MAX_RECEIVE_BYTES
    )  # grpc's default (grpc-go's defaultClientMaxReceiveMessageSize)
    channel = Channel(grpcio_server)
    try:
        stream = channel.stream(ECHO, bytes, bytes)
        await stream.send(b"x" * DEFAULT_MAX_RECEIVE_BYTES)
        assert len(await asyncio.wait_for(stream.recv(), 10)) == DEFAULT_MAX_RECEIVE_BYTES
        await stream.send(b"x" * (DEFAULT_MAX_RECEIVE_BYTES + 1))
        with pytest.raises(RpcError) as failed:
            await asyncio.wait_for(stream.recv(), 10)
        assert failed.value.code == Status.RESOURCE_EXHAUSTED
        assert failed.value.details == "grpc: received message larger than max (4194305 vs. 4194304)"
        assert stream.done()
    finally:
        channel.close()


async def test_a_call_may_accept_more_than_its_channel(grpcio_server: str) -> None:
    channel = Channel(grpcio_server, max_receive_bytes=1024)
    try:
        stream = channel.stream(ECHO, bytes, bytes, max_receive_bytes=2 * MiB)
        await stream.send(b"y" * (2 * MiB))
        assert len(await asyncio.wait_for(stream.recv(), 10)) == 2 * MiB
        await stream.done_writing()
        assert await stream.recv() is None
        with pytest.raises(RpcError) as failed:
            await channel.unary(ECHO, b"z" * 1025, bytes, timeout=5)
        assert failed.value.code == Status.RESOURCE_EXHAUSTED
    finally:
        channel.close()


# -- refused before buffered -----------------------------------------------------------------------
ANNOUNCED = 200 * MiB


def _prefix(length: int) -> bytes:
    return b"\x00" + length.to_bytes(4, "big")


async def _peak_growth(action: Callable[[], Awaitable[None]]) -> int:
    """Peak traced memory while ``action`` runs, beyond what was allocated before it."""
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        await action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


class RawClient:
    """An HTTP/2 client that sends exactly the frames it is told to."""

    def __init__(self, settings: dict[int, int] | None = None) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.settings = settings or {}
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    async def connect(self, path: str) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(path)
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values=self.settings)
        self.h2.max_inbound_frame_size = self.h2.local_settings.max_frame_size
        self.h2.incoming_buffer.max_frame_size = self.h2.local_settings.max_frame_size
        self.h2.initiate_connection()
        await self.flush()

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    async def call(self, path: str, data: bytes = b"", *, end: bool = False) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
        ]
        self.h2.send_headers(stream_id, headers)
        if data or end:
            self.h2.send_data(stream_id, data, end_stream=end)
        await self.flush()
        return stream_id

    async def events(self, timeout: float) -> list[Any]:
        data = await asyncio.wait_for(self.reader.read(1 << 20), timeout)
        if not data:
            raise ConnectionError("closed")
        events = self.h2.receive_data(data)
        await self.flush()
        return events

    def close(self) -> None:
        self.writer.close()


async def test_the_server_refuses_an_announced_length_over_its_maximum_before_buffering(
    our_server: str,
) -> None:
    client = RawClient()
    trailers: dict[bytes, bytes] = {}

    async def refused() -> None:
        await client.connect(our_server.removeprefix("unix:"))
        await client.call(ECHO, _prefix(ANNOUNCED) + b"x" * 1000)
        while not trailers:
            for event in await client.events(5):
                if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    headers = dict(event.headers)
                    if b"grpc-status" in headers:
                        trailers.update(headers)

    try:
        growth = await _peak_growth(refused)
    finally:
        client.close()
    assert trailers[b"grpc-status"] == str(Status.RESOURCE_EXHAUSTED.value).encode()
    assert f"({ANNOUNCED} vs. {LARGE})".encode() in trailers[b"grpc-message"]
    assert growth < 4 * MiB, f"{growth / MiB:.1f} MiB allocated for a refused {ANNOUNCED // MiB} MiB message"


class RawServer:
    """An HTTP/2 server answering every call with response headers and the bytes it is given."""

    def __init__(self, body: bytes, settings: dict[int, int] | None = None) -> None:
        self.body = body
        self.settings = settings or {}
        self.resets: list[int] = []
        self.client_settings: dict[int, int] = {}
        self.connection_window_increments: list[int] = []
        self.server: asyncio.Server

    async def start(self, path: Path) -> None:
        self.server = await asyncio.start_unix_server(self._serve, str(path))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        conn.send_headers(
                            event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                        )
                        conn.send_data(event.stream_id, self.body)
                    elif isinstance(event, h2.events.StreamReset):
                        self.resets.append(event.error_code)
                    elif isinstance(event, h2.events.RemoteSettingsChanged):
                        for code, change in event.changed_settings.items():
                            self.client_settings[code] = change.new_value
                    elif isinstance(event, h2.events.WindowUpdated) and event.stream_id == 0:
                        self.connection_window_increments.append(event.delta)
                writer.write(conn.data_to_send())
        except (ConnectionError, h2.exceptions.ProtocolError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def test_the_client_refuses_an_announced_length_over_its_maximum_before_buffering(
    short_tmp: Path,
) -> None:
    server = RawServer(_prefix(ANNOUNCED) + b"x" * 1000)
    await server.start(short_tmp / "raw.sock")
    channel = Channel(f"unix:{short_tmp / 'raw.sock'}")
    errors: list[RpcError] = []

    async def refused() -> None:
        stream = channel.stream(ECHO, bytes, bytes)
        await stream.send(b"hello")
        try:
            await asyncio.wait_for(stream.recv(), 5)
        except RpcError as err:
            errors.append(err)
        await asyncio.sleep(0.1)  # the reset reaches the server

    try:
        growth = await _peak_growth(refused)
    finally:
        channel.close()
        await server.stop()
    assert errors and errors[0].code == Status.RESOURCE_EXHAUSTED
    assert (
        errors[0].details
        == f"grpc: received message larger than max ({ANNOUNCED} vs. {DEFAULT_MAX_RECEIVE_BYTES})"
    )
    assert growth < 4 * MiB, f"{growth / MiB:.1f} MiB allocated for a refused {ANNOUNCED // MiB} MiB message"
    assert server.resets == [h2.errors.ErrorCodes.CANCEL]  # the call ends there, as grpc-go's does


# -- flow control ----------------------------------------------------------------------------------
async def give(call: ServerCall) -> None:
    """Sends the message a request asks for: its first 4 bytes are the size."""
    async for request in call:
        await call.send(payload(int.from_bytes(request[:4], "big")))


async def test_a_large_response_to_a_peer_with_a_tiny_window_waits_for_it_and_arrives_whole(
    short_tmp: Path,
) -> None:
    server = RpcServer(limits=uds.ServerLimits())
    server.add_stream(GIVE, give, bytes, bytes)
    path = short_tmp / "give.sock"
    await server.start(sock=uds.listen(path, "test server"))
    window = 1000
    client = RawClient({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    size = 3 * MiB
    received = bytearray()
    try:
        await client.connect(str(path))
        stream_id = await client.call(GIVE, _prefix(4) + size.to_bytes(4, "big"))
        # Without WINDOW_UPDATE the server sends no more than the window allows, then waits.
        with pytest.raises(TimeoutError):
            while True:
                for event in await client.events(0.5):
                    if isinstance(event, h2.events.DataReceived):
                        received += event.data
        assert len(received) == window
        # Open the window as the data is read: the rest arrives, in order.
        client.h2.acknowledge_received_data(window, stream_id)
        await client.flush()
        while len(received) < size + 5:
            for event in await client.events(10):
                if isinstance(event, h2.events.DataReceived):
                    received += event.data
                    client.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
            await client.flush()
    finally:
        client.close()
        await server.stop(None)
    assert bytes(received[:5]) == _prefix(size)
    assert len(received) == size + 5


# -- held once -------------------------------------------------------------------------------------
async def test_a_message_relayed_server_to_client_is_held_once(short_tmp: Path) -> None:
    """From the bytes a handler sends to the bytes the client hands out: one copy of the message (the
    receive buffer), plus frames in flight. grpclib's own paths (the previous build) peaked at 2.05x
    (the prefixed copy, the received chunks, their join)."""
    size = 16 * MiB
    message = payload(size)

    async def send_it(call: ServerCall) -> None:
        await call.recv()
        await call.send(message)

    server = RpcServer(limits=uds.ServerLimits())
    server.add_stream(GIVE, send_it, bytes, bytes)
    path = short_tmp / "once.sock"
    await server.start(sock=uds.listen(path, "test server"))
    channel = Channel(f"unix:{path}", max_receive_bytes=LARGE)
    received: list[Any] = []

    async def relay() -> None:
        stream = channel.stream(GIVE, bytes, bytearray)
        await stream.send(b"go")
        received.append(await asyncio.wait_for(stream.recv(), 30))

    try:
        growth = await _peak_growth(relay)
    finally:
        channel.close()
        await server.stop(None)
    assert received[0] == message
    assert growth < 1.3 * size, f"peak {growth / size:.2f}x the message"


async def test_sending_to_a_peer_that_allows_huge_frames_copies_no_more_than_a_frame(short_tmp: Path) -> None:
    """grpcio announces 16 MiB frames and opens a wide window: a message sent as one frame would be
    copied whole by h2's framing and asyncio's transport buffer. Frames stay small instead.

    The peer is a raw h2 client that counts the bytes and drops them, so what is traced is the
    sending side's."""
    size = 8 * MiB
    message = payload(size)

    async def send_it(call: ServerCall) -> None:
        await call.recv()
        await call.send(message)

    server = RpcServer(limits=uds.ServerLimits())
    server.add_stream(GIVE, send_it, bytes, bytes)
    path = short_tmp / "frames.sock"
    await server.start(sock=uds.listen(path, "test server"))
    wide = 2**31 - 1
    client = RawClient(
        {
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 2**24 - 1,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: wide,
        }
    )
    frames: list[int] = []

    async def sent() -> None:
        await client.connect(str(path))
        client.h2.increment_flow_control_window(wide - 65535)
        await client.call(GIVE, _prefix(2) + b"go")
        while sum(frames) < size + 5:
            for event in await client.events(10):
                if isinstance(event, h2.events.DataReceived):
                    frames.append(len(event.data))

    try:
        growth = await _peak_growth(sent)
    finally:
        client.close()
        await server.stop(None)
    assert sum(frames) == size + 5
    assert max(frames) <= 64 * 1024
    assert growth < 0.25 * size, f"sending allocated {growth / size:.2f}x the message"


async def test_the_client_opens_the_windows_istios_agent_opens(short_tmp: Path) -> None:
    """1 MiB for each stream and for the connection, as Istio's agent dials istiod
    (pilot/pkg/grpc/grpc.go ClientOptions: defaultInitialWindowSize, defaultInitialConnWindowSize):
    what istiod may send ahead of the relay, which the agent holds until it reads it."""
    server = RawServer(_prefix(2) + b"ok")
    await server.start(short_tmp / "raw.sock")
    channel = Channel(f"unix:{short_tmp / 'raw.sock'}")
    try:
        stream = channel.stream(ECHO, bytes, bytes)
        await stream.send(b"hello")
        assert await asyncio.wait_for(stream.recv(), 5) == b"ok"
    finally:
        channel.close()
        await server.stop()
    assert server.client_settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE] == MiB
    assert 65535 + sum(server.connection_window_increments) == MiB
