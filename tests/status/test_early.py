"""The start-up status server: readiness answered at once, other requests handed to the full server intact."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from aiohttp import web

from istio_agent.status.early import EarlyStatusServer, bind_status_socket
from istio_agent.status.readiness import Readiness
from istio_agent.status.server import StatusServer

pytestmark = pytest.mark.both_loops


class Scripted:
    def __init__(self, error: str | None = None) -> None:
        self.error = error

    async def check(self) -> str | None:
        return self.error


async def exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    sock = bind_status_socket("127.0.0.1", 0)
    yield sock
    sock.close()


async def test_readiness_is_answered_with_the_reason(listening: socket.socket) -> None:
    prober = Scripted("config not received from XDS server (is Istiod running?)")
    readiness = Readiness([prober])
    early = EarlyStatusServer(listening, readiness)
    await early.start()
    port = listening.getsockname()[1]
    answer = await exchange(port, b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert answer.endswith(b"\r\n\r\nconfig not received from XDS server (is Istiod running?)\n")
    assert not readiness.became_ready.is_set()
    prober.error = None
    answer = await exchange(port, b"HEAD /healthz/ready?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 0" in answer
    assert readiness.became_ready.is_set()
    assert not early.full_server_wanted.is_set()
    await early.close()


async def test_other_requests_wait_for_the_full_server_and_get_its_answer(listening: socket.socket) -> None:
    quits: list[int] = []

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(text=f"metrics for {request.remote}\n")

    early = EarlyStatusServer(listening, Readiness([Scripted("not yet")]))
    await early.start()
    port = listening.getsockname()[1]
    # Sent in two pieces: the head is only complete with the second one.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stats/prometheus HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(b"Accept: text/plain\r\nConnection: close\r\n\r\n")
    quit_answer = asyncio.ensure_future(
        exchange(
            port, b"POST /quitquitquit HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
    )
    await asyncio.wait_for(early.full_server_wanted.wait(), 5)

    full = StatusServer("127.0.0.1", port, Readiness([]), metrics=metrics, on_quit=lambda: quits.append(1))
    await full.start(listening)
    early.hand_over(full.protocol_factory)
    await early.close()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"metrics for 127.0.0.1\n")
    assert (await quit_answer).startswith(b"HTTP/1.1 200 OK") and quits == [1]
    # New connections now reach the full server directly.
    assert (
        await exchange(port, b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    ).startswith(b"HTTP/1.1 200 OK")
    await full.stop()


async def test_closing_without_a_full_server_drops_waiting_connections(listening: socket.socket) -> None:
    early = EarlyStatusServer(listening, Readiness([]))
    await early.start()
    port = listening.getsockname()[1]
    waiting = asyncio.ensure_future(exchange(port, b"GET /app-health/app/readyz HTTP/1.1\r\nHost: x\r\n\r\n"))
    await asyncio.wait_for(early.full_server_wanted.wait(), 5)
    await early.close()
    assert await waiting == b""


async def test_an_endless_request_head_is_cut_off(listening: socket.socket) -> None:
    early = EarlyStatusServer(listening, Readiness([]))
    await early.start()
    port = listening.getsockname()[1]
    assert await exchange(port, b"GET /healthz/ready HTTP/1.1\r\nX: " + b"a" * 20000) == b""
    await early.close()


def test_a_port_in_use_is_named() -> None:
    taken = bind_status_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=r"status server cannot listen on 127\.0\.0\.1:\d+"):
            bind_status_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
