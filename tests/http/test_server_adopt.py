"""A connection accepted elsewhere (a port shared with gRPC) handed to the HTTP/1.1 server with its first bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from istio_agent.http.messages import Request, Response, StreamResponse
from istio_agent.http.server import ServerRunner

pytestmark = [pytest.mark.both_loops, pytest.mark.timeout(20)]


class _Sniffer(asyncio.Protocol):
    """Reads the first four bytes itself, then hands the connection to the runner."""

    def __init__(self, runner: ServerRunner) -> None:
        self._runner = runner
        self._first = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._first += data
        if len(self._first) >= 4:
            self._runner.adopt(self._transport, self._first)  # type: ignore[arg-type]


@pytest.fixture
async def adopted() -> AsyncIterator[Callable[..., object]]:
    servers: list[tuple[asyncio.Server, ServerRunner]] = []

    async def start(handler: Callable[[Request], object]) -> int:
        runner = ServerRunner(handler)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Sniffer(runner), "127.0.0.1", 0)
        servers.append((server, runner))
        return int(server.sockets[0].getsockname()[1])

    yield start
    for server, runner in servers:
        server.close()
        await runner.cleanup(timeout=1)


async def test_an_adopted_connection_is_served_from_its_first_bytes_on(
    adopted: Callable[..., object],
) -> None:
    async def hello(request: Request) -> StreamResponse:
        return Response(text=f"{request.method} {request.path}")

    port = await adopted(hello)  # type: ignore[misc]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")  # the sniffer keeps "GET "
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(8) == b"GET /one"
        writer.write(b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert await reader.readexactly(8) == b"GET /two"
    finally:
        writer.close()


async def test_an_adopted_connection_is_read_only_as_fast_as_it_is_answered(
    adopted: Callable[..., object],
) -> None:
    answer = asyncio.Event()

    async def slow(request: Request) -> StreamResponse:
        await answer.wait()
        return Response(text="late")

    port = await adopted(slow)  # type: ignore[misc]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    chunk, sent = b"x" * 65536, 0
    try:
        async with asyncio.timeout(1):
            while sent < 256 * 2**20:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
    except TimeoutError:
        pass
    finally:
        answer.set()
        writer.close()
    assert sent < 32 * 2**20, f"the server took {sent >> 20} MiB it had not asked for"


async def test_cleanup_closes_an_adopted_idle_connection() -> None:
    async def hello(request: Request) -> StreamResponse:
        return Response(text="hi")

    runner = ServerRunner(hello)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Sniffer(runner), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert runner.connections == 1
    server.close()
    await runner.cleanup(timeout=1)
    assert await asyncio.wait_for(reader.read(), 5) == b"hi"  # the rest of the body, then the close
    writer.close()
