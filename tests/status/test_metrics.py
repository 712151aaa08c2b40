"""Merged metrics (docs/status.md) against fake Envoy and app servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from istio_agent.config.prometheus import PrometheusTargets, ScrapeTarget
from istio_agent.http.messages import Handler
from istio_agent.http.server import ServerRunner, TCPSite
from istio_agent.metrics import Registry
from istio_agent.status.metrics import (
    DEFAULT_BODY_CAP,
    DEFAULT_SCRAPE_TIMEOUT,
    HOLD_MAX,
    MetricsFormat,
    MetricsMerger,
    format_of,
    negotiate_accept,
    scrape_timeout,
    strip_eof,
)
from tests.aiohttp_apps import serve_app

TEXT_CT = "text/plain; version=0.0.4; charset=utf-8"
OM1_CT = "application/openmetrics-text; version=1.0.0; charset=utf-8"
OM0_CT = "application/openmetrics-text; version=0.0.1; charset=utf-8"
ENVOY_BODY = b'# TYPE envoy_cluster_upstream_cx_total counter\nenvoy_cluster_upstream_cx_total{c="a"} 7\n'
APP_BODY = b"# TYPE app_requests counter\napp_requests 3\n"
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)

FakeHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Fake:
    """A fake upstream (Envoy's 15090 listener or an app) recording what it was asked."""

    port: int
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


class Servers:
    """Starts fakes (aiohttp, an independent peer) and the merged endpoint (the agent's HTTP server)."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.ours: list[ServerRunner] = []
        self.release = asyncio.Event()  # lets hanging fakes finish at teardown
        self.mergers: list[MetricsMerger] = []
        self.registry = Registry()  # the agent's registry for these tests: nothing global to diff

    async def serve_merger(self, handler: Handler) -> int:
        runner = ServerRunner(handler, shutdown_timeout=0.5)
        site = TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.ours.append(runner)
        return site.port

    async def _serve(self, handler: FakeHandler) -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner, port = await serve_app(app, shutdown_timeout=0.5)
        self.runners.append(runner)
        return port

    async def fake(self, handler: FakeHandler) -> Fake:
        fake = Fake(0)

        async def recording(request: web.Request) -> web.StreamResponse:
            fake.requests.append((request.path_qs, dict(request.headers)))
            return await handler(request)

        fake.port = await self._serve(recording)
        return fake

    async def static(
        self, body: bytes, content_type: str = "text/plain; version=0.0.4", status: int = 200
    ) -> Fake:
        async def handler(request: web.Request) -> web.StreamResponse:
            return web.Response(body=body, status=status, headers={"Content-Type": content_type})

        return await self.fake(handler)

    async def merged(
        self,
        *,
        envoy: int | None,
        app: PrometheusTargets | None,
        registry: Registry | None = None,
        body_cap: int = DEFAULT_BODY_CAP,
    ) -> int:
        merger = MetricsMerger(
            registry if registry is not None else self.registry,
            envoy_port=envoy,
            app=app,
            body_cap=body_cap,
        )
        self.mergers.append(merger)
        return await self.serve_merger(merger.handle)

    async def close(self) -> None:
        self.release.set()
        for merger in self.mergers:
            await merger.close()
        for ours in self.ours:
            await ours.cleanup()
        for runner in reversed(self.runners):
            await runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        await s.close()


def targets(*fakes: Fake, path: str = "/metrics") -> PrometheusTargets:
    return PrometheusTargets(targets=tuple(ScrapeTarget(f.port, path) for f in fakes))


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def scrape(port: int, headers: dict[str, str] | None = None, query: str = "") -> tuple[str, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/stats/prometheus{query}", headers=headers or {}) as response,
    ):
        assert response.status == 200
        return response.headers["Content-Type"], await response.read()


def failures(servers: Servers, kind: str) -> float:
    return servers.registry.sample("istio_agent_scrape_failures_total", {"type": kind}) or 0.0


def up(servers: Servers, target: str) -> float | None:
    return servers.registry.sample("istio_agent_scrape_target_up", {"target": target})


# --- order and content -------------------------------------------------------------------------


async def test_agent_then_envoy_then_app(servers: Servers) -> None:
    envoy = await servers.static(ENVOY_BODY)
    app = await servers.static(APP_BODY)
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    content_type, body = await scrape(port)
    assert content_type == TEXT_CT
    agent_at = body.index(b"# TYPE istio_agent_scrapes_total gauge\n")
    envoy_at = body.index(ENVOY_BODY)
    assert agent_at < envoy_at < body.index(APP_BODY)
    assert body.endswith(APP_BODY)
    assert servers.registry.sample("istio_agent_scrapes_total") == 1
    assert b"istio_agent_scrapes_total 1.0\n" in body  # this scrape is counted in its own output
    assert b"istio_agent_scrape_failures_total" in body
    assert up(servers, "envoy") == 1
    assert up(servers, f"app:{app.port}/metrics") == 1


async def test_agent_registry_rendered_as_text(servers: Servers) -> None:
    registry = Registry()
    registry.gauge("startup_duration_seconds", "startup").set(1.5)
    port = await servers.merged(envoy=None, app=None, registry=registry)
    content_type, body = await scrape(port, headers={"Accept": "application/openmetrics-text;version=1.0.0"})
    assert content_type == TEXT_CT
    assert body.startswith(
        b"# HELP istio_agent_startup_duration_seconds startup\n"
        b"# TYPE istio_agent_startup_duration_seconds gauge\n"
        b"istio_agent_startup_duration_seconds 1.5\n"
    )
    # The merger counts into the registry it exposes, as every subsystem counts into the agent's.
    assert b"\nistio_agent_scrapes_total 1.0\n" in body
    assert registry.sample("istio_agent_scrapes_total") == 1


async def test_envoy_only_and_query_string_appended(servers: Servers) -> None:
    envoy = await servers.static(ENVOY_BODY, content_type="application/openmetrics-text; version=1.0.0")
    port = await servers.merged(envoy=envoy.port, app=None)
    content_type, body = await scrape(port, query="?usedonly&filter=cluster%20x")
    assert content_type == TEXT_CT  # Envoy's Content-Type is ignored
    assert body.endswith(ENVOY_BODY)
    assert envoy.requests[0][0] == "/stats/prometheus?usedonly&filter=cluster%20x"


async def test_app_only_without_envoy(servers: Servers) -> None:
    app = await servers.static(APP_BODY)
    port = await servers.merged(envoy=None, app=targets(app))
    _, body = await scrape(port)
    assert body.endswith(APP_BODY)
    assert ENVOY_BODY not in body


async def test_duplicate_families_across_envoy_and_app_passed_through(servers: Servers) -> None:
    envoy = await servers.static(APP_BODY)
    app = await servers.static(APP_BODY)
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    _, body = await scrape(port)
    assert body.count(APP_BODY) == 2


async def test_headers_forwarded_and_accept_negotiated(servers: Servers) -> None:
    envoy = await servers.static(ENVOY_BODY)
    app = await servers.static(APP_BODY)
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    headers = {
        "Accept": PROMETHEUS_ACCEPT,
        "User-Agent": "Prometheus/2.53.0",
        "X-Prometheus-Scrape-Timeout-Seconds": "5",
    }
    await scrape(port, headers=headers)
    for fake in (envoy, app):
        sent = fake.requests[0][1]
        assert sent["User-Agent"] == "Prometheus/2.53.0"
        assert sent["X-Prometheus-Scrape-Timeout-Seconds"] == "5"
        assert sent["Accept-Encoding"] == "identity"
    assert envoy.requests[0][1]["Accept"] == "text/plain;version=0.0.4;q=0.1"
    assert app.requests[0][1]["Accept"] == (
        "application/openmetrics-text;version=1.0.0;q=0.3,"
        "application/openmetrics-text;version=0.0.1;q=0.2,"
        "text/plain;version=0.0.4;q=0.1"
    )


async def test_gzip_when_the_scraper_accepts_it(servers: Servers) -> None:
    envoy = await servers.static(ENVOY_BODY * 100)
    port = await servers.merged(envoy=envoy.port, app=None)
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept-Encoding": "gzip"}) as response,
    ):
        assert response.headers["Content-Encoding"] == "gzip"
        body = gzip.decompress(await response.read())
    assert body.endswith(ENVOY_BODY * 100)


# --- Accept negotiation ------------------------------------------------------------------------

APP_ACCEPT_CASES = [
    (
        PROMETHEUS_ACCEPT,
        "application/openmetrics-text;version=1.0.0;q=0.3,"
        "application/openmetrics-text;version=0.0.1;q=0.2,text/plain;version=0.0.4;q=0.1",
    ),
    (
        "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,"
        + PROMETHEUS_ACCEPT,
        "application/openmetrics-text;version=1.0.0;q=0.3,"
        "application/openmetrics-text;version=0.0.1;q=0.2,text/plain;version=0.0.4;q=0.1",
    ),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily", "text/plain;version=0.0.4"),
    ("application/openmetrics-text", "application/openmetrics-text;q=0.1"),
    ("application/openmetrics-text; version=1.0.0", "application/openmetrics-text;version=1.0.0;q=0.1"),
    ("text/plain", "text/plain;q=0.1"),
    ("text/plain;version=0.0.4;q=0.5", "text/plain;version=0.0.4;q=0.1"),
    ("text/*", "text/*;q=0.1"),
    ("*/*", "text/plain;version=0.0.4;q=0.1"),
    ("*", "text/plain;version=0.0.4;q=0.1"),
    ("application/*", "application/openmetrics-text;version=0.0.1;q=0.1"),
    ("application/*,*/*", "application/openmetrics-text;version=0.0.1;q=0.2,text/plain;version=0.0.4;q=0.1"),
    ("text/plain;version=0.0.4,*/*", "text/plain;version=0.0.4;q=0.1"),
    ("*/*,*", "text/plain;version=0.0.4;q=0.1"),
    ("Application/OpenMetrics-Text", "application/openmetrics-text;q=0.1"),
    ("text/html", "text/plain;version=0.0.4"),
    ("application/json, image/png", "text/plain;version=0.0.4"),
    ("/", "text/plain;version=0.0.4"),
    ("", "text/plain;version=0.0.4"),
    (None, "text/plain;version=0.0.4"),
    (",,,", "text/plain;version=0.0.4"),
    ("text/plain;version", "text/plain;version=0.0.4"),
    ("/, text/plain", "text/plain;q=0.1"),
    (
        ",".join(f"text/plain;v={i}" for i in range(12)),
        ",".join(f"text/plain;v={i};q=0.{9 - i}" for i in range(9)),
    ),
]


@pytest.mark.parametrize(("accept", "expected"), APP_ACCEPT_CASES)
def test_accept_for_app(accept: str | None, expected: str) -> None:
    assert negotiate_accept(accept, openmetrics=True) == expected


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (PROMETHEUS_ACCEPT, "text/plain;version=0.0.4;q=0.1"),
        ("application/openmetrics-text;version=1.0.0", "text/plain;version=0.0.4"),
        ("application/*", "text/plain;version=0.0.4"),
        ("application/*,text/*", "text/*;q=0.1"),
        ("text/plain, text/*", "text/plain;q=0.2,text/*;q=0.1"),
        ("*/*", "text/plain;version=0.0.4;q=0.1"),
        ("application/vnd.google.protobuf", "text/plain;version=0.0.4"),
        ("/", "text/plain;version=0.0.4"),
    ],
)
def test_accept_for_envoy(accept: str, expected: str) -> None:
    assert negotiate_accept(accept, openmetrics=False) == expected


# --- Content-Type ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("upstream", "expected"),
    [
        ("application/openmetrics-text; version=1.0.0; charset=utf-8", MetricsFormat.OPENMETRICS_1_0_0),
        ("application/openmetrics-text;version=1.0.0", MetricsFormat.OPENMETRICS_1_0_0),
        ('application/openmetrics-text; version="1.0.0"', MetricsFormat.OPENMETRICS_1_0_0),
        ("application/openmetrics-text; version=0.0.1; charset=utf-8", MetricsFormat.OPENMETRICS_0_0_1),
        ("application/openmetrics-text", MetricsFormat.OPENMETRICS_0_0_1),
        ("application/openmetrics-text; version=2.0.0", MetricsFormat.TEXT),
        ("text/plain; version=0.0.4; charset=utf-8", MetricsFormat.TEXT),
        ("application/json", MetricsFormat.TEXT),
        ("", MetricsFormat.TEXT),
        (None, MetricsFormat.TEXT),
        ("garbage;;=", MetricsFormat.TEXT),
    ],
)
def test_format_of(upstream: str | None, expected: MetricsFormat) -> None:
    assert format_of(upstream) is expected


@pytest.mark.parametrize(
    ("upstream", "expected"),
    [
        ("application/openmetrics-text; version=1.0.0; charset=utf-8", OM1_CT),
        ("application/openmetrics-text; version=0.0.1", OM0_CT),
        ("application/openmetrics-text", OM0_CT),
        ("text/plain; version=0.0.4", TEXT_CT),
        ("application/octet-stream", TEXT_CT),
    ],
)
async def test_single_app_content_type(servers: Servers, upstream: str, expected: str) -> None:
    app = await servers.static(APP_BODY + b"# EOF\n", content_type=upstream)
    port = await servers.merged(envoy=None, app=targets(app))
    content_type, body = await scrape(port)
    assert content_type == expected
    assert body.endswith(APP_BODY + b"# EOF\n")  # a single target is passed through verbatim


async def test_no_app_is_text_whatever_the_scraper_asks(servers: Servers) -> None:
    port = await servers.merged(envoy=None, app=None)
    content_type, _ = await scrape(port, headers={"Accept": "application/openmetrics-text;version=1.0.0"})
    assert content_type == TEXT_CT


# --- multiple targets --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"a 1\n# EOF\n", b"a 1\n"),
        (b"a 1\n# EOF", b"a 1\n"),
        (b"a 1\r\n# EOF\r\n", b"a 1\r\n"),
        (b"a 1\n# EOF  \r\n\n", b"a 1\n"),
        (b"a 1", b"a 1\n"),
        (b"a 1\n", b"a 1\n"),
        (b"# EOF\n", b""),
        (b"", b""),
        (b"a 1\nfoo# EOF\n", b"a 1\nfoo# EOF\n"),
    ],
)
def test_strip_eof(raw: bytes, expected: bytes) -> None:
    body = bytearray(raw)
    strip_eof(body)
    assert body == expected


async def test_multi_target_openmetrics_single_eof_in_order(servers: Servers) -> None:
    om = "application/openmetrics-text; version=1.0.0"
    first = await servers.static(b"a_total 1\n# EOF\n", content_type=om)
    second = await servers.static(b"b_total 2\r\n# EOF\r\n", content_type=om)
    third = await servers.static(b"c_total 3", content_type=om)
    envoy = await servers.static(ENVOY_BODY)
    port = await servers.merged(envoy=envoy.port, app=targets(first, second, third))
    content_type, body = await scrape(port)
    assert content_type == OM1_CT
    assert body.endswith(ENVOY_BODY + b"a_total 1\nb_total 2\r\nc_total 3\n# EOF\n")
    assert body.count(b"# EOF") == 1


async def test_multi_target_mixed_formats_downgrade_to_text(servers: Servers) -> None:
    first = await servers.static(b"a 1\n# EOF\n", content_type="application/openmetrics-text; version=1.0.0")
    second = await servers.static(b"b 2\n", content_type="text/plain; version=0.0.4")
    port = await servers.merged(envoy=None, app=targets(first, second))
    content_type, body = await scrape(port)
    assert content_type == TEXT_CT
    assert body.endswith(b"a 1\nb 2\n")
    assert b"# EOF" not in body


async def test_multi_target_om_versions_disagree_is_text(servers: Servers) -> None:
    first = await servers.static(b"a 1\n", content_type="application/openmetrics-text; version=1.0.0")
    second = await servers.static(b"b 2\n", content_type="application/openmetrics-text; version=0.0.1")
    port = await servers.merged(envoy=None, app=targets(first, second))
    content_type, _ = await scrape(port)
    assert content_type == TEXT_CT


async def test_multi_target_failing_target_skipped_format_from_first_success(servers: Servers) -> None:
    broken = await servers.static(b"nope", status=500)
    ok = await servers.static(b"b 2\n# EOF\n", content_type="application/openmetrics-text")
    ok2 = await servers.static(b"c 3\n", content_type="application/openmetrics-text; version=0.0.1")
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(broken, ok, ok2))
    content_type, body = await scrape(port)
    assert content_type == OM0_CT
    assert body.endswith(b"b 2\nc 3\n# EOF\n")
    assert b"nope" not in body
    assert failures(servers, "application") == before + 1
    assert up(servers, f"app:{broken.port}/metrics") == 0
    assert up(servers, f"app:{ok.port}/metrics") == 1


async def test_multi_target_all_failing_still_envoy_and_agent(servers: Servers) -> None:
    envoy = await servers.static(ENVOY_BODY)
    down = closed_port()
    bad = await servers.static(b"x", status=404)
    before = failures(servers, "application")
    app = PrometheusTargets(targets=(ScrapeTarget(down, "/metrics"), ScrapeTarget(bad.port, "/metrics")))
    port = await servers.merged(envoy=envoy.port, app=app)
    content_type, body = await scrape(port)
    assert content_type == TEXT_CT
    assert b"istio_agent_scrapes_total" in body
    assert body.endswith(ENVOY_BODY)
    assert failures(servers, "application") == before + 2


async def test_multi_target_cap_exactly_kept_one_more_dropped(servers: Servers) -> None:
    line = b"x" * 1023 + b"\n"
    exact = line * (DEFAULT_BODY_CAP // len(line))
    assert len(exact) == DEFAULT_BODY_CAP
    kept = await servers.static(exact)
    dropped = await servers.static(exact + b"\n")
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(kept, dropped))
    _, body = await scrape(port)
    assert body.endswith(exact)
    assert body.count(line) == len(exact) // len(line)  # the second body is not there at all
    assert failures(servers, "application") == before + 1
    assert up(servers, f"app:{dropped.port}/metrics") == 0


async def test_multi_target_cap_without_content_length(servers: Servers) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(5):
            await response.write(b"y 1\n" * 64)
        return response

    big = await servers.fake(chunked)
    small = await servers.static(b"s 1\n")
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(big, small), body_cap=1000)
    _, body = await scrape(port)
    assert b"y 1" not in body
    assert body.endswith(b"s 1\n")
    assert failures(servers, "application") == before + 1


# --- single target: streaming, cap, garbage ----------------------------------------------------


def streaming_app(chunk: bytes, total: int, content_type: str = "text/plain") -> FakeHandler:
    """An app streaming ``total`` bytes of ``chunk`` repeated, without ever holding them."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": content_type})
        await response.prepare(request)
        sent = 0
        try:
            while sent < total:
                await response.write(chunk)
                sent += len(chunk)
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the agent hung up at its cap
        return response

    return handler


async def test_single_app_100mb_is_cut_at_the_cap_with_bounded_memory(servers: Servers) -> None:
    line = b'app_big_metric{i="0123456789"} 1\n'
    chunk = line * (64 * 1024 // len(line))
    app = await servers.fake(streaming_app(chunk, 100 * 2**20))
    envoy = await servers.static(ENVOY_BODY)
    before = failures(servers, "application")
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        received = 0
        tail = b""
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"http://127.0.0.1:{port}/stats/prometheus", headers={"Accept-Encoding": "identity"}
            ) as response,
        ):
            async for piece in response.content.iter_any():
                received += len(piece)
                tail = (tail + piece)[-len(line) * 2 :]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < DEFAULT_BODY_CAP // 2  # buffering the body up to the cap would exceed this
    assert DEFAULT_BODY_CAP - len(line) < received <= DEFAULT_BODY_CAP + 64 * 1024
    assert tail.endswith(line)  # cut at a line boundary: what was sent stays valid
    assert failures(servers, "application") == before + 1
    assert up(servers, f"app:{app.port}/metrics") == 0


async def test_multi_target_huge_apps_bounded_by_targets_times_cap(servers: Servers) -> None:
    cap = 2**20
    chunk = b"m 1\n" * (16 * 1024)
    first = await servers.fake(streaming_app(chunk, 100 * 2**20))
    second = await servers.fake(streaming_app(chunk, 100 * 2**20))
    small = await servers.static(b"small 1\n")
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(first, second, small), body_cap=cap)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        _, out = await scrape(port, headers={"Accept-Encoding": "identity"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * cap + 2**20  # two targets buffered up to the cap, plus read chunks
    assert out.endswith(b"small 1\n")
    assert b"m 1" not in out
    assert failures(servers, "application") == before + 2


async def test_client_hanging_up_mid_scrape_closes_upstream(servers: Servers) -> None:
    aborted = asyncio.Event()
    big = streaming_app(b"e 1\n" * 16384, 500 * 2**20)

    async def envoy_handler(request: web.Request) -> web.StreamResponse:
        if aborted.is_set():
            return web.Response(body=ENVOY_BODY)
        try:
            return await big(request)
        finally:
            aborted.set()  # the big stream ended: only because the agent closed the connection

    envoy = await servers.fake(envoy_handler)
    port = await servers.merged(envoy=envoy.port, app=None)
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        await response.content.readexactly(1000)
    await asyncio.wait_for(aborted.wait(), 5)
    _, out = await scrape(port)
    assert out.endswith(ENVOY_BODY)


async def test_single_app_exactly_cap_kept(servers: Servers) -> None:
    cap = 4096
    body = (b"z 1\n" * (cap // 4))[:cap]
    app = await servers.fake(streaming_app(body, len(body)))
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(app), body_cap=cap)
    _, out = await scrape(port)
    assert out.endswith(body)
    assert failures(servers, "application") == before
    assert up(servers, f"app:{app.port}/metrics") == 1


async def test_single_app_cap_plus_one_cut_cleanly(servers: Servers) -> None:
    cap = 4096
    body = b"z 1\n" * (cap // 4) + b"w"
    app = await servers.fake(streaming_app(body, len(body)))
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(app), body_cap=cap)
    _, out = await scrape(port)
    assert out.endswith(b"z 1\n")
    assert b"w" not in out.split(b"z 1\n", 1)[1]
    assert failures(servers, "application") == before + 1


async def test_single_app_content_length_over_cap_not_read(servers: Servers) -> None:
    app = await servers.static(b"q 1\n" * 300)
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(app), body_cap=1000)
    content_type, out = await scrape(port)
    assert b"q 1" not in out
    assert content_type == TEXT_CT
    assert failures(servers, "application") == before + 1


async def test_single_openmetrics_app_cut_off_still_ends_with_eof(servers: Servers) -> None:
    app = await servers.fake(
        streaming_app(b"om_metric_total 1\n" * 100, 10_000, "application/openmetrics-text")
    )
    port = await servers.merged(envoy=None, app=targets(app), body_cap=5000)
    content_type, out = await scrape(port)
    assert content_type == OM0_CT
    assert out.endswith(b"om_metric_total 1\n# EOF\n")


async def test_garbage_app_body_passed_through_byte_for_byte(servers: Servers) -> None:
    garbage = bytes(range(256)) * 8 + b"\xff\xfe no newline at the end"
    app = await servers.static(garbage, content_type="application/octet-stream")
    envoy = await servers.static(ENVOY_BODY)
    before = failures(servers, "application")
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    content_type, out = await scrape(port)
    assert content_type == TEXT_CT
    assert out.endswith(ENVOY_BODY + garbage)
    assert failures(servers, "application") == before


async def test_long_line_garbage_streamed_past_the_hold_limit(servers: Servers) -> None:
    garbage = b"\x00" * (3 * HOLD_MAX + 17)
    app = await servers.fake(streaming_app(garbage, len(garbage)))
    port = await servers.merged(envoy=None, app=targets(app))
    _, out = await scrape(port)
    assert out.endswith(garbage)


async def test_app_non_200_is_a_failure(servers: Servers) -> None:
    app = await servers.static(b"secret_app_error_page", status=503)
    envoy = await servers.static(ENVOY_BODY)
    before = failures(servers, "application")
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    content_type, out = await scrape(port)
    assert content_type == TEXT_CT
    assert out.endswith(ENVOY_BODY)
    assert b"secret_app_error_page" not in out
    assert failures(servers, "application") == before + 1


# --- hanging and missing upstreams --------------------------------------------------------------


async def test_hanging_app_bounded_by_scrape_timeout(servers: Servers) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await servers.release.wait()
        return web.Response(text="late 1\n")

    app = await servers.fake(hang)
    envoy = await servers.static(ENVOY_BODY)
    before = failures(servers, "application")
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    started = time.monotonic()
    _, out = await scrape(port, headers={"X-Prometheus-Scrape-Timeout-Seconds": "0.5"})
    assert time.monotonic() - started < 3
    assert b"istio_agent_scrapes_total" in out
    assert out.endswith(ENVOY_BODY)
    assert failures(servers, "application") == before + 1


async def test_app_hanging_mid_body_is_cut_at_a_line(servers: Servers) -> None:
    async def stall(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/openmetrics-text; version=1.0.0"})
        await response.prepare(request)
        await response.write(b"first_total 1\nsecond_tot")
        await servers.release.wait()
        return response

    app = await servers.fake(stall)
    envoy = await servers.static(ENVOY_BODY)
    before = failures(servers, "application")
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    content_type, out = await scrape(port, headers={"X-Prometheus-Scrape-Timeout-Seconds": "0.5"})
    assert content_type == OM1_CT
    assert out.endswith(ENVOY_BODY + b"first_total 1\n# EOF\n")
    assert failures(servers, "application") == before + 1


async def test_hanging_target_among_several(servers: Servers) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await servers.release.wait()
        return web.Response(text="late 1\n")

    slow = await servers.fake(hang)
    fast = await servers.static(b"fast 1\n")
    before = failures(servers, "application")
    port = await servers.merged(envoy=None, app=targets(slow, fast))
    _, out = await scrape(port, headers={"X-Prometheus-Scrape-Timeout-Seconds": "0.5"})
    assert out.endswith(b"fast 1\n")
    assert failures(servers, "application") == before + 1


async def test_envoy_down_still_agent_and_app(servers: Servers) -> None:
    app = await servers.static(APP_BODY)
    before = failures(servers, "envoy")
    port = await servers.merged(envoy=closed_port(), app=targets(app))
    content_type, out = await scrape(port)
    assert content_type == TEXT_CT
    assert b"istio_agent_scrapes_total" in out
    assert out.endswith(APP_BODY)
    assert failures(servers, "envoy") == before + 1
    assert up(servers, "envoy") == 0


async def test_envoy_non_200_is_a_failure(servers: Servers) -> None:
    envoy = await servers.static(b"envoy_error_page", status=500)
    before = failures(servers, "envoy")
    port = await servers.merged(envoy=envoy.port, app=None)
    _, out = await scrape(port)
    assert b"envoy_error_page" not in out
    assert failures(servers, "envoy") == before + 1


async def test_envoy_body_without_trailing_newline_gets_one(servers: Servers) -> None:
    envoy = await servers.static(b"envoy_x 1")
    app = await servers.static(APP_BODY)
    port = await servers.merged(envoy=envoy.port, app=targets(app))
    _, out = await scrape(port)
    assert out.endswith(b"envoy_x 1\n" + APP_BODY)


async def test_all_upstreams_failing_is_still_200(servers: Servers) -> None:
    port = await servers.merged(envoy=closed_port(), app=targets(Fake(closed_port())))
    content_type, out = await scrape(port)
    assert content_type == TEXT_CT
    assert b"istio_agent_scrapes_total" in out


async def test_broken_agent_collector_counted(servers: Servers) -> None:
    class Broken:
        def collect(self) -> list[object]:
            raise RuntimeError("collector exploded")

    registry = Registry()
    registry.register(Broken())  # type: ignore[arg-type]
    envoy = await servers.static(ENVOY_BODY)
    port = await servers.merged(envoy=envoy.port, app=None, registry=registry)
    _, out = await scrape(port)
    assert out == ENVOY_BODY
    assert registry.sample("istio_agent_scrape_failures_total", {"type": "agent"}) == 1


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, DEFAULT_SCRAPE_TIMEOUT),
        ("0.5", 0.5),
        ("10", 10.0),
        ("abc", DEFAULT_SCRAPE_TIMEOUT),
        ("-1", DEFAULT_SCRAPE_TIMEOUT),
        ("0", DEFAULT_SCRAPE_TIMEOUT),
        ("inf", DEFAULT_SCRAPE_TIMEOUT),
        ("nan", DEFAULT_SCRAPE_TIMEOUT),
    ],
)
def test_scrape_timeout(header: str | None, expected: float) -> None:
    assert scrape_timeout(header) == expected


async def test_close_is_idempotent_and_merger_reusable(servers: Servers) -> None:
    envoy = await servers.static(ENVOY_BODY)
    merger = MetricsMerger(Registry(), envoy_port=envoy.port, app=None)
    await merger.close()  # never used: nothing to close
    port = await servers.serve_merger(merger.handle)
    await scrape(port)
    await merger.close()
    _, out = await scrape(port)  # a new session is made on demand
    assert out.endswith(ENVOY_BODY)
    await merger.close()
