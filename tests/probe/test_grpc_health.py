"""The one gRPC health client: grpc's messages on the wire, decoded answers, the deadline told."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1.health_pb2 import HealthCheckResponse

from istio_agent.http import h2client
from istio_agent.probe import grpc_health
from istio_agent.probe.source import ProbeSource

pytestmark = pytest.mark.timeout(20)

# Answers by requested service, as raw bytes: an independent encoding of HealthCheckResponse.
ANSWERS = {
    "empty": b"",  # status absent: UNKNOWN
    "serving": b"\x08\x01",
    # unknown fields of every wire type are skipped; the last value wins
    "noisy": b"\x08\x02\x12\x02ab\x19" + b"\0" * 8 + b"\x25" + b"\0" * 4 + b"\x08\x01",
    "not-serving": b"\x08\x02",
    "future-status": b"\x08\x07",
    "garbage": b"\x08",  # a truncated varint
}


@dataclass
class Seen:
    port: int = 0
    requests: list[bytes] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)


@pytest.fixture
async def server() -> AsyncIterator[Seen]:
    seen = Seen()

    async def check(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.requests.append(request)
        seen.time_remaining.append(context.time_remaining())
        return ANSWERS[request[2:].decode()]

    app = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}
    )
    app.add_generic_rpc_handlers((handler,))
    seen.port = app.add_insecure_port("127.0.0.1:0")
    await app.start()
    try:
        yield seen
    finally:
        await app.stop(None)


async def status_of(seen: Seen, service: str, deadline: float | None = None) -> int:
    return await grpc_health.check(ProbeSource(), "127.0.0.1", seen.port, service, deadline=deadline)


@pytest.mark.parametrize(
    ("service", "status"),
    [
        ("empty", HealthCheckResponse.UNKNOWN),
        ("serving", grpc_health.SERVING),
        ("noisy", grpc_health.SERVING),
        ("not-serving", HealthCheckResponse.NOT_SERVING),
        ("future-status", 7),
    ],
)
async def test_answers_decode(server: Seen, service: str, status: int) -> None:
    assert await status_of(server, service) == status
    assert server.requests == [b"\x0a" + bytes([len(service)]) + service.encode()]


async def test_a_malformed_answer_is_an_error(server: Seen) -> None:
    with pytest.raises(grpc_health.HealthResponseError, match="malformed health check response"):
        await status_of(server, "garbage")


async def test_the_deadline_is_told_to_the_server(server: Seen) -> None:
    await status_of(server, "serving")
    await status_of(server, "serving", deadline=asyncio.get_running_loop().time() + 5)
    assert server.time_remaining[0] is None
    remaining = server.time_remaining[1]
    assert remaining is not None and 3 < remaining <= 5


async def test_connect_errors_are_os_errors() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once it is closed
    with pytest.raises(ConnectionRefusedError):
        await grpc_health.check(ProbeSource(), "127.0.0.1", port, "")


async def test_unknown_service_is_a_grpc_error(server: Seen) -> None:
    with pytest.raises(h2client.GrpcError) as info:
        await status_of(server, "missing")  # the servicer raises KeyError: UNKNOWN
    assert info.value.code == h2client.UNKNOWN
