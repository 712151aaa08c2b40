"""Kubelet's app probes (the status server's handler) against real HTTP/HTTPS/TCP/gRPC applications on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from istio_agent.config.probes import (
    AppProber,
    GRPCCheck,
    HTTPGetCheck,
    TCPCheck,
    parse_app_probers,
)
from istio_agent.http import h2client
from istio_agent.http.messages import Request, StreamResponse
from istio_agent.http.server import ServerRunner, TCPSite
from istio_agent.probe.kubelet import AppProbes
from tests.http.h2server import H2Server, Reply, Seen, tls_server_context

pytestmark = pytest.mark.timeout(20)


@dataclass
class App:
    """The application under probe: records what it saw."""

    port: int = 0
    remotes: list[str] = field(default_factory=list)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)


def make_app(app_state: App) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        code = int(request.match_info["code"])
        return web.Response(status=code, body=b"" if code in (204, 304) else f"code={code}".encode())

    async def echo(request: web.Request) -> web.Response:
        app_state.remotes.append(request.remote or "")
        payload = {
            "headers": [[k, v] for k, v in request.headers.items()],
            "remote": request.remote,
            "version": f"{request.version.major}.{request.version.minor}",
            "path": request.path_qs,
        }
        return web.json_response(payload)

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 20000)

    async def slow(request: web.Request) -> web.Response:
        await app_state.stalled.wait()  # never set: the probe must time out
        return web.Response()

    async def hops(request: web.Request) -> web.Response:
        left = int(request.match_info["n"])
        if left == 0:
            return web.Response(text="arrived")
        raise web.HTTPFound(f"/hops/{left - 1}")

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def other_host(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://localhost:{app_state.port}/status/503")

    async def same_host_absolute(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{app_state.port}/echo")

    async def relative_to_echo(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("/echo")

    app = web.Application()
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/echo", echo)
    app.router.add_get("/big", big)
    app.router.add_get("/slow", slow)
    app.router.add_get("/hops/{n}", hops)
    app.router.add_get("/loop", loop)
    app.router.add_get("/other-host", other_host)
    app.router.add_get("/same-host-absolute", same_host_absolute)
    app.router.add_get("/relative", relative_to_echo)
    return app


async def serve(
    app: web.Application, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
) -> web.AppRunner:
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, host, 0, ssl_context=tls).start()
    return runner


def port_of(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


@pytest.fixture
async def app() -> AsyncIterator[App]:
    state = App()
    runner = await serve(make_app(state))
    state.port = port_of(runner)
    yield state
    await runner.cleanup()


@dataclass
class ProbeClient:
    """Kubelet's side: GETs to the status-server stand-in (aiohttp's client, an independent peer)."""

    session: aiohttp.ClientSession
    port: int

    async def get(self, path: str, **kwargs: object) -> aiohttp.ClientResponse:
        return await self.session.get(f"http://127.0.0.1:{self.port}{path}", **kwargs)  # type: ignore[arg-type]


Prober = Callable[..., Awaitable[ProbeClient]]


@pytest.fixture
async def status_server() -> AsyncIterator[Prober]:
    """Builds a status-server stand-in (the agent's HTTP server) mounting AppProbes.handle."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def build(
        probers: dict[str, AppProber], pod_ip: str = "127.0.0.1", **kwargs: object
    ) -> ProbeClient:
        holder: dict[str, AppProbes] = {}

        async def handle(request: Request) -> StreamResponse:
            return await holder["probes"].handle(request)

        runner = ServerRunner(handle, shutdown_timeout=0.5)
        site = TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        session = aiohttp.ClientSession()
        probes = AppProbes(probers, pod_ip=pod_ip, status_port=site.port, **kwargs)  # type: ignore[arg-type]
        holder["probes"] = probes
        cleanups.append(runner.cleanup)
        cleanups.append(session.close)
        cleanups.append(probes.close)
        return ProbeClient(session, site.port)

    yield build
    for cleanup in reversed(cleanups):
        await cleanup()


def http(path: str, port: int, timeout: int = 0, scheme: str = "http") -> AppProber:
    return AppProber(HTTPGetCheck(port=port, path=path, scheme=scheme), timeout)


# --- HTTP ------------------------------------------------------------------------------------------


async def test_unknown_path_is_400(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/status/200", app.port)})
    response = await client.get("/app-health/web/livez")
    assert response.status == 400
    assert await response.text() == "app prober config does not exists for /app-health/web/livez"


@pytest.mark.parametrize("code", [200, 201, 204, 206, 400, 401, 404, 418, 500, 503, 511])
async def test_status_passed_through(app: App, status_server: Prober, code: int) -> None:
    client = await status_server({"/app-health/web/readyz": http(f"/status/{code}", app.port)})
    response = await client.get("/app-health/web/readyz")
    assert response.status == code
    assert await response.read() == (b"" if code == 204 else f"code={code}".encode())


@pytest.mark.parametrize("code", [300, 301, 302, 304, 307])
async def test_3xx_becomes_200_without_body(app: App, status_server: Prober, code: int) -> None:
    client = await status_server({"/app-health/web/livez": http(f"/status/{code}", app.port)})
    response = await client.get("/app-health/web/livez")
    assert response.status == 200
    assert await response.read() == b""


async def test_readyz_livez_and_lifecycle(app: App, status_server: Prober) -> None:
    probers = parse_app_probers(
        json.dumps(
            {
                "/app-health/web/readyz": {"httpGet": {"path": "/status/200", "port": app.port}},
                "/app-health/web/livez": {"httpGet": {"path": "status/503", "port": app.port}},
                "/app-lifecycle/web/prestopz": {"httpGet": {"path": "/status/201", "port": app.port}},
            }
        )
    )
    client = await status_server(probers)
    assert (await client.get("/app-health/web/readyz")).status == 200
    assert (await client.get("/app-health/web/livez")).status == 503  # path without leading "/"
    assert (await client.get("/app-lifecycle/web/prestopz")).status == 201


async def test_headers_copied_host_rewritten_connection_close(app: App, status_server: Prober) -> None:
    # The prober's own httpHeaders are kubelet's business: the agent must not add them.
    prober = AppProber(HTTPGetCheck(port=app.port, path="/echo", headers=(("X-Config", "nope"),)))
    client = await status_server({"/app-health/web/readyz": prober})
    status_port = client.port
    response = await client.get(
        "/app-health/web/readyz",
        headers=[("X-Custom", "a"), ("X-Multi", "1"), ("X-Multi", "2"), ("User-Agent", "kube-probe/1.30")],
    )
    assert response.status == 200
    seen = await response.json(content_type=None)
    headers = seen["headers"]
    assert ["X-Custom", "a"] in headers
    assert [v for k, v in headers if k == "X-Multi"] == ["1", "2"]
    assert ["User-Agent", "kube-probe/1.30"] in headers
    assert ["Host", f"127.0.0.1:{app.port}"] in headers  # status port replaced by the app port
    assert status_port != app.port
    assert ["Connection", "close"] in headers
    assert not [k for k, _ in headers if k.lower() == "x-config"]
    assert seen["remote"] == "127.0.0.6"


async def test_host_without_status_port_kept(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/echo", app.port)})
    response = await client.get("/app-health/web/readyz", headers={"Host": "myapp.example:1234"})
    assert ["Host", "myapp.example:1234"] in (await response.json(content_type=None))["headers"]


async def test_keepalive_reuses_connection(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/echo", app.port)}, keepalive=True)
    first = await (await client.get("/app-health/web/readyz")).json(content_type=None)
    await (await client.get("/app-health/web/readyz")).json(content_type=None)
    assert not [k for k, v in first["headers"] if k.lower() == "connection" and v.lower() == "close"]
    assert app.remotes == ["127.0.0.6", "127.0.0.6"]


async def test_body_capped_at_10k(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/big", app.port)})
    response = await client.get("/app-health/web/readyz")
    assert response.status == 200
    assert await response.read() == b"x" * 10240


async def test_pod_ip_localhost(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/echo", app.port)}, pod_ip="localhost")
    response = await client.get("/app-health/web/readyz")
    assert response.status == 200


async def test_same_host_redirects_followed(app: App, status_server: Prober) -> None:
    client = await status_server(
        {
            "/app-health/web/readyz": http("/hops/10", app.port),
            "/app-health/web/livez": http("/hops/11", app.port),
            "/app-health/web/startupz": http("/loop", app.port),
            "/app-lifecycle/web/prestopz": http("/relative", app.port),
            "/app-lifecycle/web/poststartz": http("/same-host-absolute", app.port),
        }
    )
    ten = await client.get("/app-health/web/readyz")
    assert (ten.status, await ten.text()) == (200, "arrived")
    assert (await client.get("/app-health/web/livez")).status == 500  # 11th redirect
    assert (await client.get("/app-health/web/startupz")).status == 500
    relative = await client.get("/app-lifecycle/web/prestopz", headers={"Host": "kept.example:1"})
    assert ["Host", "kept.example:1"] in (await relative.json(content_type=None))["headers"]
    absolute = await client.get("/app-lifecycle/web/poststartz", headers={"Host": "dropped.example:1"})
    assert ["Host", f"127.0.0.1:{app.port}"] in (await absolute.json(content_type=None))["headers"]


async def test_other_host_redirect_returned_as_200(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/other-host", app.port)})
    response = await client.get("/app-health/web/readyz")
    assert response.status == 200  # the 302 itself; following it would give 503


async def test_timeout_is_500(app: App, status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/slow", app.port, timeout=1)})
    started = time.monotonic()
    response = await client.get("/app-health/web/readyz")
    assert response.status == 500
    assert time.monotonic() - started < 5


async def test_connection_refused_is_500(status_server: Prober) -> None:
    client = await status_server({"/app-health/web/readyz": http("/", closed_port())})
    assert (await client.get("/app-health/web/readyz")).status == 500


# --- HTTPS -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpn", "http2"),
    [
        (None, True),  # no ALPN from the app: HTTP/1.1
        (["http/1.1"], True),  # h2 offered, the app picks http/1.1
        (["h2", "http/1.1"], False),  # HTTP/2 probing off: h2 is never offered
    ],
)
async def test_https_http1(
    tmp_path: Path, status_server: Prober, alpn: list[str] | None, http2: bool
) -> None:
    # aiohttp's server speaks only HTTP/1.1 (it would fail an h2 connection it advertised).
    state = App()
    runner = await serve(make_app(state), tls=tls_server_context(tmp_path, alpn))
    try:
        client = await status_server(
            {"/app-health/web/readyz": http("/echo", port_of(runner), scheme="https")}, http2=http2
        )
        response = await client.get("/app-health/web/readyz")
        assert response.status == 200
        seen = await response.json(content_type=None)
        assert seen["version"] == "1.1"
        assert seen["remote"] == "127.0.0.6"
    finally:
        await runner.cleanup()


async def test_https_prober_against_plain_http_fails(app: App, status_server: Prober) -> None:
    client = await status_server(
        {"/app-health/web/readyz": http("/echo", app.port, timeout=2, scheme="https")}
    )
    assert (await client.get("/app-health/web/readyz")).status == 500


# --- HTTPS over HTTP/2 -----------------------------------------------------------------------------


async def h2_app_handler(seen: Seen) -> Reply:
    """The HTTP/2 twin of make_app's routes."""
    path = seen.header(":path") or ""
    app_port = (seen.header(":authority") or "").rpartition(":")[2]
    if path == "/echo":
        return Reply(body=json.dumps({"headers": seen.headers, "remote": seen.peer}).encode())
    if path.startswith("/status/"):
        code = int(path.rpartition("/")[2])
        return Reply(status=code, body=b"" if code in (204, 304) else f"code={code}".encode())
    if path == "/big":
        return Reply(body=b"x" * 20000)
    if path.startswith("/hops/"):
        left = int(path.rpartition("/")[2])
        return (
            Reply(body=b"arrived")
            if left == 0
            else Reply(status=302, headers=[("location", f"/hops/{left - 1}")])
        )
    if path == "/other-host":
        return Reply(status=302, headers=[("location", f"https://localhost:{app_port}/status/503")])
    if path == "/slow":
        return Reply(stall=True)
    return Reply(status=404)


@pytest.fixture(params=[["h2"], ["h2", "http/1.1"]], ids=["h2-only", "h2+h1"])
async def h2_app(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[H2Server]:
    server = await H2Server(h2_app_handler, tls_server_context(tmp_path, request.param)).start()
    yield server
    await server.close()


def https(path: str, port: int, timeout: int = 0) -> AppProber:
    return http(path, port, timeout, scheme="https")


async def test_https_h2(h2_app: H2Server, status_server: Prober) -> None:
    prober = AppProber(
        HTTPGetCheck(port=h2_app.port, path="/echo", scheme="https", headers=(("X-Config", "no"),))
    )
    client = await status_server({"/app-health/web/readyz": prober})
    response = await client.get(
        "/app-health/web/readyz",
        headers=[("X-Custom", "a"), ("X-Multi", "1"), ("X-Multi", "2"), ("User-Agent", "kube-probe/1.30")],
    )
    assert response.status == 200
    seen = await response.json(content_type=None)
    headers = [tuple(pair) for pair in seen["headers"]]
    assert headers[:4] == [
        (":method", "GET"),
        (":scheme", "https"),
        (":authority", f"127.0.0.1:{h2_app.port}"),  # status port replaced by the app port
        (":path", "/echo"),
    ]
    assert ("x-custom", "a") in headers
    assert [v for k, v in headers if k == "x-multi"] == ["1", "2"]
    assert ("user-agent", "kube-probe/1.30") in headers
    assert not [k for k, _ in headers if k in ("connection", "host", "x-config")]
    assert seen["remote"] == "127.0.0.6"


@pytest.mark.parametrize("code", [200, 204, 400, 404, 503])
async def test_https_h2_status_passed_through(h2_app: H2Server, status_server: Prober, code: int) -> None:
    client = await status_server({"/app-health/web/readyz": https(f"/status/{code}", h2_app.port)})
    response = await client.get("/app-health/web/readyz")
    assert response.status == code
    assert await response.read() == (b"" if code == 204 else f"code={code}".encode())


@pytest.mark.parametrize("code", [301, 302, 304, 307])
async def test_https_h2_3xx_becomes_200(h2_app: H2Server, status_server: Prober, code: int) -> None:
    client = await status_server({"/app-health/web/readyz": https(f"/status/{code}", h2_app.port)})
    response = await client.get("/app-health/web/readyz")
    assert (response.status, await response.read()) == (200, b"")


async def test_https_h2_redirects_body_cap_timeout(h2_app: H2Server, status_server: Prober) -> None:
    client = await status_server(
        {
            "/app-health/web/readyz": https("/hops/10", h2_app.port),
            "/app-health/web/livez": https("/hops/11", h2_app.port),
            "/app-health/web/startupz": https("/other-host", h2_app.port),
            "/app-lifecycle/web/prestopz": https("/big", h2_app.port),
            "/app-lifecycle/web/poststartz": https("/slow", h2_app.port, timeout=1),
        }
    )
    ten = await client.get("/app-health/web/readyz")
    assert (ten.status, await ten.text()) == (200, "arrived")
    assert (await client.get("/app-health/web/livez")).status == 500  # 11th redirect
    assert (await client.get("/app-health/web/startupz")).status == 200  # the 302 itself, not the 503
    big = await client.get("/app-lifecycle/web/prestopz")
    assert (big.status, await big.read()) == (200, b"x" * 10240)
    started = time.monotonic()
    assert (await client.get("/app-lifecycle/web/poststartz")).status == 500
    assert time.monotonic() - started < 5
    assert {seen.peer for seen in h2_app.seen} == {"127.0.0.6"}
    assert len(h2_app.seen) == 11 + 11 + 1 + 1 + 1  # the 11th redirect is not followed


async def test_http2_probing_off_never_offers_h2(tmp_path: Path, status_server: Prober) -> None:
    server = await H2Server(h2_app_handler, tls_server_context(tmp_path, ["h2"])).start()
    try:
        client = await status_server({"/app-health/web/readyz": https("/echo", server.port, 2)}, http2=False)
        assert (await client.get("/app-health/web/readyz")).status == 500  # HTTP/1.1 to an h2-only app
        assert server.seen == []
    finally:
        await server.close()


async def test_alpn_refused_by_app_is_500(tmp_path: Path, status_server: Prober) -> None:
    # Go's TLS server, for one, ends the handshake when it shares no protocol with the client's
    # ALPN offer; this app does that to every client.
    tls = tls_server_context(tmp_path, ["foo"])
    tls.sni_callback = lambda *_: 120  # no_application_protocol
    server = await H2Server(h2_app_handler, tls).start()
    try:
        client = await status_server({"/app-health/web/readyz": https("/echo", server.port, 2)})
        assert (await client.get("/app-health/web/readyz")).status == 500
    finally:
        await server.close()


async def test_unknown_alpn_is_500(
    h2_app: H2Server, status_server: Prober, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # OpenSSL itself rejects a protocol the client did not offer, so pretend one got through.
    monkeypatch.setattr(h2client.Connection, "alpn", property(lambda self: "spdy/3"))
    client = await status_server({"/app-health/web/readyz": https("/echo", h2_app.port, 2)})
    with caplog.at_level(logging.INFO, logger="istio.healthcheck"):
        assert (await client.get("/app-health/web/readyz")).status == 500
    assert h2_app.seen == []
    assert "unsupported ALPN protocol 'spdy/3'" in caplog.text


# --- TCP -------------------------------------------------------------------------------------------


def closed_port(host: str = "127.0.0.1", family: int = socket.AF_INET) -> int:
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def tcp_listener(host: str) -> tuple[asyncio.Server, list[str]]:
    peers: list[str] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[0])
        writer.close()

    server = await asyncio.start_server(accepted, host, 0)
    return server, peers


@pytest.mark.parametrize(
    ("listen", "pod_ip", "source"),
    [("127.0.0.1", "127.0.0.1", "127.0.0.6"), ("127.0.0.1", "localhost", "127.0.0.6"), ("::1", "::1", "::1")],
)
async def test_tcp_probe(status_server: Prober, listen: str, pod_ip: str, source: str) -> None:
    server, peers = await tcp_listener(listen)
    try:
        port = server.sockets[0].getsockname()[1]
        client = await status_server(
            {
                "/app-health/web/readyz": AppProber(TCPCheck(port=port), 1),
                "/app-health/web/livez": AppProber(
                    TCPCheck(port=closed_port(listen, socket.AF_INET6 if ":" in listen else socket.AF_INET)),
                    1,
                ),
            },
            pod_ip=pod_ip,
        )
        assert (await client.get("/app-health/web/readyz")).status == 200
        assert (await client.get("/app-health/web/livez")).status == 500
        async with asyncio.timeout(5):
            while not peers:
                await asyncio.sleep(0.01)
        # ::6 is not a local address here: the probe falls back to the default source.
        assert peers[0] == source
    finally:
        server.close()
        await server.wait_closed()


async def test_tcp_bracketed_pod_ip_fails(status_server: Prober) -> None:
    server, _ = await tcp_listener("::1")
    try:
        port = server.sockets[0].getsockname()[1]
        client = await status_server(
            {"/app-health/web/readyz": AppProber(TCPCheck(port=port), 1)}, pod_ip="[::1]"
        )
        assert (await client.get("/app-health/web/readyz")).status == 500
    finally:
        server.close()
        await server.wait_closed()


# --- gRPC ------------------------------------------------------------------------------------------

STATUSES = {"": 1, "svc": 1, "down": 2, "unknown": 0, "gone": 3}


def parse_service(request: bytes) -> str:
    # HealthCheckRequest{string service = 1}: tag, one-byte length (short names only), bytes.
    return request[2:].decode() if request else ""


def encode_status(status: int) -> bytes:
    return b"" if status == 0 else bytes([0x08, status])


@dataclass
class HealthServer:
    port: int
    user_agents: list[str]
    peers: list[str] = field(default_factory=list)
    hung: asyncio.Event = field(default_factory=asyncio.Event)


async def grpc_server(host: str, health: bool = True) -> tuple[grpc.aio.Server, HealthServer]:
    state = HealthServer(0, [])

    async def check(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        metadata = dict(context.invocation_metadata() or ())
        state.user_agents.append(str(metadata.get("user-agent", "")))
        state.peers.append(context.peer())
        service = parse_service(request)
        if service == "hang":
            state.hung.set()
            await asyncio.Event().wait()  # cancelled when the server stops
        if service not in STATUSES:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return encode_status(STATUSES[service])

    server = grpc.aio.server()
    if health:
        handler = grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)}
        )
        server.add_generic_rpc_handlers((handler,))
    state.port = server.add_insecure_port(f"{'[::1]' if host == '::1' else host}:0")
    await server.start()
    return server, state


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_grpc_probe(status_server: Prober, host: str) -> None:
    server, state = await grpc_server(host)
    try:
        probers = {
            f"/app-health/c/{kind}": AppProber(GRPCCheck(port=state.port, service=service), 2)
            for kind, service in [("livez", ""), ("readyz", "svc"), ("startupz", "down")]
        }
        probers["/app-lifecycle/c/prestopz"] = AppProber(GRPCCheck(port=state.port, service="unknown"), 2)
        probers["/app-lifecycle/c/poststartz"] = AppProber(GRPCCheck(port=state.port, service="nope"), 2)
        client = await status_server(probers, pod_ip=host)
        response = await client.get("/app-health/c/livez", headers={"User-Agent": "kube-probe/1.30"})
        assert response.status == 200
        assert state.user_agents[0].startswith("kube-probe/1.30")
        assert (await client.get("/app-health/c/readyz")).status == 200
        assert (await client.get("/app-health/c/startupz")).status == 500  # NOT_SERVING
        assert (await client.get("/app-lifecycle/c/prestopz")).status == 500  # UNKNOWN
        assert (await client.get("/app-lifecycle/c/poststartz")).status == 500  # NotFound
        # 127.0.0.6 where it is a local address; ::6 is not, so IPv6 probes come from ::1.
        source = "ipv4:127.0.0.6:" if host == "127.0.0.1" else "ipv6:%5B::1%5D:"
        assert len(state.peers) == 5
        assert all(peer.startswith(source) for peer in state.peers), state.peers
    finally:
        await server.stop(None)


async def test_grpc_probe_logs(status_server: Prober, caplog: pytest.LogCaptureFixture) -> None:
    server, state = await grpc_server("127.0.0.1")
    bare, bare_state = await grpc_server("127.0.0.1", health=False)
    try:
        client = await status_server(
            {
                "/app-health/c/livez": AppProber(GRPCCheck(port=state.port, service="nope"), 2),
                "/app-health/c/readyz": AppProber(GRPCCheck(port=bare_state.port), 2),
                "/app-health/c/startupz": AppProber(GRPCCheck(port=state.port, service="down"), 2),
            }
        )
        with caplog.at_level(logging.INFO, logger="istio.healthcheck"):
            for kind in ("livez", "readyz", "startupz"):
                assert (await client.get(f"/app-health/c/{kind}")).status == 500
        assert (
            "app probe /app-health/c/livez failed: grpc probe failed: "
            "rpc error: code = NotFound desc = unknown service"
        ) in caplog.text
        assert (
            "app probe /app-health/c/readyz failed: server does not implement the grpc health protocol "
            "(grpc.health.v1.Health): rpc error: code = Unimplemented"
        ) in caplog.text
        assert "app probe /app-health/c/startupz failed: gRPC health status 2" in caplog.text
    finally:
        await server.stop(None)
        await bare.stop(None)


async def test_grpc_timeout(status_server: Prober) -> None:
    server, state = await grpc_server("127.0.0.1")
    try:
        client = await status_server(
            {"/app-health/c/livez": AppProber(GRPCCheck(port=state.port, service="hang"), 1)}
        )
        started = time.monotonic()
        assert (await client.get("/app-health/c/livez")).status == 500
        assert time.monotonic() - started < 5
        assert state.hung.is_set()
    finally:
        await server.stop(None)


async def test_grpc_unimplemented_and_closed(status_server: Prober) -> None:
    server, state = await grpc_server("127.0.0.1", health=False)
    try:
        client = await status_server(
            {
                "/app-health/c/livez": AppProber(GRPCCheck(port=state.port), 2),
                "/app-health/c/readyz": AppProber(GRPCCheck(port=closed_port()), 1),
            }
        )
        assert (await client.get("/app-health/c/livez")).status == 500
        assert (await client.get("/app-health/c/readyz")).status == 500
    finally:
        await server.stop(None)


async def test_ipv6_source_falls_back_once(status_server: Prober, caplog: pytest.LogCaptureFixture) -> None:
    # ::6 is not a local address on this host: binding it fails, probes go out from ::1, logged once.
    state = App()
    runner = await serve(make_app(state), host="::1")
    server, _ = await tcp_listener("::1")
    try:
        client = await status_server(
            {
                "/app-health/web/readyz": http("/echo", port_of(runner)),
                "/app-health/web/livez": AppProber(TCPCheck(port=server.sockets[0].getsockname()[1]), 1),
            },
            pod_ip="::1",
        )
        with caplog.at_level(logging.DEBUG, logger="istio.healthcheck"):
            for _ in range(2):
                assert (await client.get("/app-health/web/readyz")).status == 200
                assert (await client.get("/app-health/web/livez")).status == 200
        assert state.remotes == ["::1", "::1"]
        fallbacks = [r for r in caplog.records if "::6" in r.getMessage()]
        assert len(fallbacks) == 1
        assert fallbacks[0].levelno == logging.DEBUG
    finally:
        server.close()
        await server.wait_closed()
        await runner.cleanup()
