"""VM health-check probers against real HTTP/TCP/gRPC servers on loopback and real processes."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from aiohttp import web

from istio_agent.config.probes import ExecCheck, GRPCCheck, HTTPGetCheck, ReadinessProbeConfig, TCPCheck
from istio_agent.envoy.readiness import EnvoyReadiness
from istio_agent.metrics import Registry
from istio_agent.probe.workload import (
    GRPC_CONFIG_NIL,
    USER_AGENT,
    EnvoyProber,
    ExecProber,
    GRPCProber,
    HTTPProber,
    ProbeResult,
    TCPProber,
    build_probers,
)
from tests.aiohttp_apps import serve_app

pytestmark = pytest.mark.timeout(20)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Seen:
    headers: list[dict[str, str]] = field(default_factory=list)
    remotes: list[str] = field(default_factory=list)


async def start_app(app: web.Application) -> tuple[web.AppRunner, int]:
    return await serve_app(app)


@pytest.fixture
async def http_app() -> AsyncIterator[tuple[int, Seen]]:
    seen = Seen()
    release = asyncio.Event()

    async def status(request: web.Request) -> web.Response:
        seen.headers.append(dict(request.headers))
        seen.remotes.append(request.remote or "")
        return web.Response(status=int(request.match_info["code"]))

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/status/204")

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    app = web.Application()
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/hang", hang)
    runner, port = await start_app(app)
    try:
        yield port, seen
    finally:
        release.set()
        await runner.cleanup()


async def test_http_healthy_sends_istio_headers_from_probe_source(http_app: tuple[int, Seen]) -> None:
    port, seen = http_app
    prober = HTTPProber(HTTPGetCheck(port=port, path="/status/200"), "127.0.0.1")
    outcome = await prober.probe(1.0)
    assert outcome.result is ProbeResult.HEALTHY and outcome.error is None
    headers = seen.headers[0]
    assert headers["User-Agent"] == USER_AGENT
    assert headers["Connection"] == "close"
    assert seen.remotes[0] == "127.0.0.6"


async def test_http_status_500_is_unhealthy_with_istio_message(http_app: tuple[int, Seen]) -> None:
    port, _ = http_app
    outcome = await HTTPProber(HTTPGetCheck(port=port, path="/status/500"), "127.0.0.1").probe(1.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == "status code was not from [200,400), bad code 500"


@pytest.mark.parametrize(("code", "healthy"), [(199, False), (204, True), (399, True), (400, False)])
async def test_http_range_boundaries(http_app: tuple[int, Seen], code: int, healthy: bool) -> None:
    port, _ = http_app
    outcome = await HTTPProber(HTTPGetCheck(port=port, path=f"/status/{code}"), "127.0.0.1").probe(1.0)
    assert outcome.healthy is healthy


async def test_http_follows_redirects(http_app: tuple[int, Seen]) -> None:
    port, seen = http_app
    outcome = await HTTPProber(HTTPGetCheck(port=port, path="/redirect"), "127.0.0.1").probe(1.0)
    assert outcome.healthy
    assert len(seen.headers) == 1  # arrived at /status/204


async def test_http_configured_headers_host_and_user_agent(http_app: tuple[int, Seen]) -> None:
    port, seen = http_app
    check = HTTPGetCheck(
        port=port,
        path="/status/200",
        host="localhost",
        headers=(("Host", "app.example"), ("User-Agent", "custom/2"), ("X-Probe", "a"), ("X-Probe", "b")),
    )
    assert (await HTTPProber(check, "10.255.255.1").probe(1.0)).healthy  # configured host beats default
    headers = seen.headers[0]
    assert headers["Host"] == "app.example"
    assert headers["User-Agent"] == "custom/2"
    assert headers["X-Probe"] in ("a", "a,b")  # dict() keeps the first of a multi-valued header


async def test_http_closed_server_is_unhealthy() -> None:
    port = closed_port()
    outcome = await HTTPProber(HTTPGetCheck(port=port), "127.0.0.1").probe(1.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert (
        outcome.error
        == f'Get "http://127.0.0.1:{port}/": dial tcp 127.0.0.1:{port}: connect: connection refused'
    )


async def test_http_timeout(http_app: tuple[int, Seen]) -> None:
    port, _ = http_app
    started = time.monotonic()
    outcome = await HTTPProber(HTTPGetCheck(port=port, path="/hang"), "127.0.0.1").probe(0.2)
    assert time.monotonic() - started < 5
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error is not None and "context deadline exceeded" in outcome.error


async def test_http_https_does_not_verify_but_plain_server_fails(http_app: tuple[int, Seen]) -> None:
    # An https probe to a plaintext server must fail (TLS handshake), not crash.
    port, _ = http_app
    outcome = await HTTPProber(HTTPGetCheck(port=port, scheme="https"), "127.0.0.1").probe(1.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error is not None and outcome.error.startswith(f'Get "https://127.0.0.1:{port}/"')


# --- TCP ------------------------------------------------------------------------------------------


async def test_tcp_open_and_closed() -> None:
    accepted: list[str] = []

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername")[0])
        writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        assert (await TCPProber(TCPCheck(port=port), "127.0.0.1").probe(1.0)).healthy
        assert (await TCPProber(TCPCheck(port=port, host="127.0.0.1"), "192.0.2.1").probe(1.0)).healthy
        async with asyncio.timeout(5):
            while len(accepted) < 2:
                await asyncio.sleep(0.01)
    finally:
        server.close()
        await server.wait_closed()
    assert accepted == ["127.0.0.6", "127.0.0.6"]  # from the probe source, like app probes
    outcome = await TCPProber(TCPCheck(port=port), "127.0.0.1").probe(1.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == f"dial tcp 127.0.0.1:{port}: connect: connection refused"


# --- gRPC -----------------------------------------------------------------------------------------

STATUSES = {"": 1, "serving": 1, "not-serving": 2, "unknown": 0, "service-unknown": 3}


@dataclass
class HealthService:
    port: int = 0
    user_agents: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)


@pytest.fixture
async def grpc_health() -> AsyncIterator[HealthService]:
    state = HealthService()

    async def check(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        metadata = dict(context.invocation_metadata() or ())
        state.user_agents.append(str(metadata.get("user-agent", "")))
        state.peers.append(context.peer())
        service = request[2:].decode() if request else ""  # HealthCheckRequest{service = 1}, short names
        if service not in STATUSES:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        status = STATUSES[service]
        return b"" if status == 0 else bytes([0x08, status])

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}
    )
    server.add_generic_rpc_handlers((handler,))
    state.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield state
    finally:
        await server.stop(None)


@pytest.mark.parametrize("service", ["", "serving"])
async def test_grpc_serving_is_healthy(grpc_health: HealthService, service: str) -> None:
    outcome = await GRPCProber(GRPCCheck(port=grpc_health.port, service=service), "127.0.0.1").probe(2.0)
    assert outcome.result is ProbeResult.HEALTHY
    assert grpc_health.user_agents[0].startswith(USER_AGENT)
    # Beyond Istio (which uses the default source for gRPC): from the probe source like every probe.
    assert grpc_health.peers[0].startswith("ipv4:127.0.0.6:")


@pytest.mark.parametrize("service", ["not-serving", "unknown", "service-unknown"])
async def test_grpc_not_serving_is_unhealthy_without_error(grpc_health: HealthService, service: str) -> None:
    outcome = await GRPCProber(GRPCCheck(port=grpc_health.port, service=service), "127.0.0.1").probe(2.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error is None


async def test_grpc_unknown_service_is_not_found(grpc_health: HealthService) -> None:
    outcome = await GRPCProber(GRPCCheck(port=grpc_health.port, service="nope"), "127.0.0.1").probe(2.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == "health rpc probe failed with status NotFound: unknown service"


async def test_grpc_unimplemented() -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        outcome = await GRPCProber(GRPCCheck(port=port), "127.0.0.1").probe(2.0)
    finally:
        await server.stop(None)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error is not None
    assert outcome.error.startswith("this server does not implement the grpc health protocol")


async def test_grpc_wrong_port_is_a_connect_error() -> None:
    port = closed_port()
    outcome = await GRPCProber(GRPCCheck(port=port), "127.0.0.1").probe(2.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == (
        f"failed to connect health check grpc service on port {port}: "
        f"dial tcp 127.0.0.1:{port}: connect: connection refused"
    )


async def test_grpc_hanging_server_times_out() -> None:
    # A listener that never speaks HTTP/2: the probe must end at its timeout.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = int(listener.getsockname()[1])
    try:
        outcome = await GRPCProber(GRPCCheck(port=port), "127.0.0.1").probe(0.3)
    finally:
        listener.close()
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error is not None
    assert outcome.error in ("health rpc probe timed out after 300ms",) or outcome.error.startswith(
        f"failed to connect health check grpc service on port {port}"
    )


async def test_grpc_nil_config_is_unknown() -> None:
    outcome = await GRPCProber(None, "127.0.0.1").probe(1.0)
    assert outcome.result is ProbeResult.UNKNOWN
    assert outcome.error == GRPC_CONFIG_NIL


# --- exec -----------------------------------------------------------------------------------------


async def test_exec_true_and_false() -> None:
    assert (await ExecProber(ExecCheck(("true",))).probe(2.0)).healthy
    outcome = await ExecProber(ExecCheck(("false",))).probe(2.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == "exit status 1"
    outcome = await ExecProber(ExecCheck(("sh", "-c", "exit 7"))).probe(2.0)
    assert outcome.error == "exit status 7"


async def test_exec_timeout_kills_the_command() -> None:
    started = time.monotonic()
    outcome = await ExecProber(ExecCheck(("sleep", "5"))).probe(0.2)
    assert time.monotonic() - started < 3
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == "command timeout exceeded: signal: killed"


async def test_exec_missing_program() -> None:
    outcome = await ExecProber(ExecCheck(("/nonexistent/probe-binary",))).probe(1.0)
    assert outcome.result is ProbeResult.UNHEALTHY
    assert outcome.error == 'exec: "/nonexistent/probe-binary": executable file not found in $PATH'


# --- Envoy and the prober chain -------------------------------------------------------------------

READY_STATS = (
    "cluster_manager.cds.update_success: 1\nlistener_manager.lds.update_success: 1\n"
    "server.state: 0\nlistener_manager.workers_started: 1\n"
)


async def test_envoy_prober_and_build_probers() -> None:
    body = {"text": ""}

    async def stats(request: web.Request) -> web.Response:
        return web.Response(text=body["text"])

    app = web.Application()
    app.router.add_get("/stats", stats)
    runner, port = await start_app(app)
    try:
        envoy = EnvoyReadiness("127.0.0.1", port, started_at=time.monotonic(), registry=Registry())
        config = ReadinessProbeConfig(check=ExecCheck(("true",)))
        probers = build_probers(config, default_host="127.0.0.1", envoy=envoy)
        assert isinstance(probers[0], EnvoyProber) and isinstance(probers[1], ExecProber)
        outcome = await probers[0].probe(1.0)
        assert outcome.result is ProbeResult.UNHEALTHY
        assert outcome.error is not None and outcome.error.startswith("config not received from XDS server")
        body["text"] = READY_STATS
        assert (await probers[0].probe(1.0)).healthy
    finally:
        await runner.cleanup()
    assert [type(p) for p in build_probers(config)] == [ExecProber]
    tcp = build_probers(ReadinessProbeConfig(check=TCPCheck(port=1)))
    assert [type(p) for p in tcp] == [TCPProber]
