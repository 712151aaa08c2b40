"""The status server over real sockets: routes, access control, quit/drain ordering, compression, lifecycle."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from istio_agent.http.messages import Request, Response, StreamResponse
from istio_agent.http.server import Limits
from istio_agent.metrics import PREFIX, Registry
from istio_agent.status.readiness import Readiness
from istio_agent.status.server import (
    StatusServer,
    is_loopback,
    negotiate_encoding,
)

BIG = "x_metric 1\n" * 500  # > 1 KiB


class Scripted:
    def __init__(self, error: str | None = None) -> None:
        self.error = error

    async def check(self) -> str | None:
        return self.error


@dataclass
class Calls:
    """What the server's collaborators saw."""

    prober: Scripted = field(default_factory=Scripted)
    metrics: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)
    quit: int = 0
    ndsz: dict[str, Any] | None = None
    secrets: dict[str, Any] | None = None
    metrics_body: str = "agent_metric 1\n"


def build(calls: Calls, host: str = "127.0.0.1", **kwargs: object) -> StatusServer:
    async def metrics(request: Request) -> StreamResponse:
        calls.metrics.append(request.path)
        return Response(text=calls.metrics_body, content_type="text/plain")

    async def probes(request: Request) -> StreamResponse:
        calls.probes.append(request.path)
        return Response(text="probed")

    def on_quit() -> None:
        calls.quit += 1

    options: dict[str, object] = {
        "metrics": metrics,
        "app_probes": probes,
        "ndsz": lambda: calls.ndsz,
        "secrets": lambda: calls.secrets,
        "on_quit": on_quit,
        "registry": Registry(),
    }
    options.update(kwargs)
    return StatusServer(host, 0, Readiness([calls.prober]), **options)  # type: ignore[arg-type]


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
async def server(calls: Calls) -> AsyncIterator[StatusServer]:
    status = build(calls)
    await status.start()
    try:
        yield status
    finally:
        await status.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def fetch(
    session: aiohttp.ClientSession, method: str, url: str, **kwargs: object
) -> tuple[int, str, aiohttp.ClientResponse]:
    async with session.request(method, url, **kwargs) as response:  # type: ignore[arg-type]
        return response.status, await response.text(), response


def url(server: StatusServer, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{server.port}{path}"


def non_loopback_ip() -> str | None:
    """A local address that is not loopback (routing lookup only: a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))
            ip = str(sock.getsockname()[0])
    except OSError:
        return None
    return None if is_loopback(ip) or ip == "0.0.0.0" else ip


# -- readiness -----------------------------------------------------------------------------------------
async def test_ready_is_200_with_empty_body_for_any_method(
    server: StatusServer, client: aiohttp.ClientSession
) -> None:
    assert server.port > 0
    for method in ("GET", "POST", "PUT", "DELETE"):
        status, body, _ = await fetch(client, method, url(server, "/healthz/ready"))
        assert (status, body) == (200, "")


async def test_probes_are_served_while_a_neighbour_floods_the_port_with_half_sent_heads(
    server: StatusServer,
) -> None:
    """Issue 20: 520 slowloris connections from one neighbour filled the cap and the pod went unready."""

    async def half_open() -> asyncio.StreamWriter:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
        writer.write(b"GET /healthz/ready HTTP/1.1\r\nHo")
        return writer

    async def probe() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz/ready HTTP/1.1\r\nHost: 10.0.0.1:15020\r\nConnection: close\r\n\r\n")
        try:
            return await asyncio.wait_for(reader.read(), 5)
        except ConnectionError:
            return b""
        finally:
            writer.close()

    flood = [await half_open() for _ in range(520)]
    try:
        answers = []
        for _ in range(20):
            flood += [await half_open() for _ in range(5)]
            answers.append(await probe())
        assert [answer.split(b"\r\n", 1)[0] for answer in answers] == [b"HTTP/1.1 200 OK"] * 20
    finally:
        for writer in flood:
            writer.close()


async def test_not_ready_is_503_with_the_reason(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    calls.prober.error = "config not received from XDS server (is Istiod running?): x"
    status, body, _ = await fetch(client, "GET", url(server, "/healthz/ready"))
    assert (status, body) == (503, "config not received from XDS server (is Istiod running?): x\n")


async def test_terminate_flips_readiness(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    assert (await fetch(client, "GET", url(server, "/healthz/ready")))[0] == 200
    server._readiness.terminate("received signal terminated")
    status, body, _ = await fetch(client, "GET", url(server, "/healthz/ready"))
    assert (status, body) == (503, "server is terminated: received signal terminated\n")


# -- metrics, app probes, unknown paths --------------------------------------------------------------
async def test_metrics_paths_use_the_metrics_handler(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    for path in ("/stats/prometheus", "/metrics"):
        status, body, _ = await fetch(client, "GET", url(server, path))
        assert (status, body) == (200, "agent_metric 1\n")
    assert calls.metrics == ["/stats/prometheus", "/metrics"]


async def test_app_probe_prefixes_use_the_probe_handler(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    for path in ("/app-health/app/readyz", "/app-lifecycle/app/prestopz"):
        assert (await fetch(client, "GET", url(server, path)))[:2] == (200, "probed")
    assert calls.probes == ["/app-health/app/readyz", "/app-lifecycle/app/prestopz"]


@pytest.mark.parametrize(
    "path", ["/", "/nope", "/healthz/ready/x", "/app-health", "/debug/pprof/", "/metricsx"]
)
async def test_unknown_paths_are_404(server: StatusServer, client: aiohttp.ClientSession, path: str) -> None:
    status, body, _ = await fetch(client, "GET", url(server, path))
    assert (status, body) == (404, "404 page not found\n")


async def test_missing_handlers_are_404(calls: Calls, client: aiohttp.ClientSession) -> None:
    status_server = StatusServer("127.0.0.1", 0, Readiness([]), registry=Registry())
    await status_server.start()
    try:
        for path in ("/metrics", "/stats/prometheus", "/app-health/a/livez", "/app-lifecycle/a/poststartz"):
            assert (await fetch(client, "GET", url(status_server, path)))[:2] == (404, "404 page not found\n")
        status, body, response = await fetch(client, "GET", url(status_server, "/debug/ndsz"))
        assert (status, body, response.content_type) == (404, "{}", "application/json")
        # no on_quit given: still answered
        assert (await fetch(client, "POST", url(status_server, "/quitquitquit")))[:2] == (200, "OK")
    finally:
        await status_server.stop()


# -- ndsz -------------------------------------------------------------------------------------------------
async def test_ndsz_serves_the_dns_view_as_json(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    status, body, response = await fetch(client, "GET", url(server, "/debug/ndsz"))
    assert (status, body, response.content_type) == (404, "{}", "application/json")
    calls.ndsz = {
        "table": {"echo.default.svc.cluster.local": {"ips": ["10.0.0.7"], "registry": "Kubernetes"}}
    }
    status, body, response = await fetch(client, "GET", url(server, "/debug/ndsz"))
    assert (status, response.content_type) == (200, "application/json")
    assert json.loads(body) == calls.ndsz


# -- secrets ----------------------------------------------------------------------------------------------
async def test_secrets_view_is_json_for_loopback_get_only(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    status, body, response = await fetch(client, "GET", url(server, "/debug/secrets"))
    assert (status, body, response.content_type) == (404, "{}", "application/json")  # no secret manager yet
    calls.secrets = {"secrets": [{"resource_name": "default", "certificates": []}], "files": []}
    status, body, response = await fetch(client, "GET", url(server, "/debug/secrets"))
    assert (status, response.content_type) == (200, "application/json")
    assert json.loads(body) == calls.secrets
    for method in ("POST", "PUT", "DELETE"):
        assert (await fetch(client, method, url(server, "/debug/secrets")))[:2] == (
            405,
            "Method Not Allowed\n",
        )


@pytest.mark.parametrize(
    "peer", [("192.0.2.9", 4000), ("10.1.2.3", 5), ("::ffff:10.0.0.1", 6), ("fe80::1", 7)]
)
async def test_secrets_view_refuses_remote_peers(calls: Calls, peer: tuple[str, int]) -> None:
    """Checked on the request's peer, so it holds even where the host has no non-loopback address."""
    calls.secrets = {"secrets": [], "files": []}
    status_server = build(calls)
    response = await status_server._handle(Request("GET", "/debug/secrets", peer=peer))
    assert isinstance(response, Response)
    assert (response.status, response.body) == (403, b"Only requests from localhost are allowed\n")


# -- quit / drain -------------------------------------------------------------------------------------
async def test_quit_and_drain_need_post(
    server: StatusServer, calls: Calls, client: aiohttp.ClientSession
) -> None:
    for path in ("/quitquitquit", "/drain"):
        for method in ("GET", "PUT"):
            status, body, _ = await fetch(client, method, url(server, path))
            assert (status, body) == (405, "Method Not Allowed\n")
    assert calls.quit == 0


def _peek_response(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def _raw_post(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n".encode())
    return sock


async def test_quit_answers_ok_before_calling_back(calls: Calls) -> None:
    seen: list[bytes] = []
    called = asyncio.Event()
    holder: dict[str, socket.socket] = {}

    def on_quit() -> None:
        seen.append(_peek_response(holder["sock"]))
        called.set()

    status_server = build(calls, on_quit=on_quit)
    await status_server.start()
    try:
        holder["sock"] = _raw_post(status_server.port, "/quitquitquit")
        with holder["sock"]:
            await asyncio.wait_for(called.wait(), 5)
        assert seen[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert seen[0].endswith(b"\r\n\r\nOK")
    finally:
        await status_server.stop()


async def test_drain_answers_ok_then_runs_the_drain(calls: Calls, client: aiohttp.ClientSession) -> None:
    seen: list[bytes] = []
    holder: dict[str, socket.socket] = {}
    release = asyncio.Event()
    finished = asyncio.Event()

    async def on_drain() -> None:
        seen.append(_peek_response(holder["sock"]))
        await release.wait()  # a drain that only ends after the client has its answer
        finished.set()

    status_server = build(calls, on_drain=on_drain)
    await status_server.start()
    try:
        holder["sock"] = _raw_post(status_server.port, "/drain")
        with holder["sock"]:
            loop = asyncio.get_running_loop()
            holder["sock"].setblocking(False)
            data = b""
            while not data.endswith(b"OK"):
                data += await asyncio.wait_for(loop.sock_recv(holder["sock"], 4096), 5)
            assert data.startswith(b"HTTP/1.1 200 OK\r\n")
            release.set()
            await asyncio.wait_for(finished.wait(), 5)
        assert seen[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert calls.quit == 0
    finally:
        await status_server.stop()


async def test_stop_cancels_a_pending_drain(calls: Calls, client: aiohttp.ClientSession) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def on_drain() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    status_server = build(calls, on_drain=on_drain)
    await status_server.start()
    assert (await fetch(client, "POST", url(status_server, "/drain")))[:2] == (200, "OK")
    await asyncio.wait_for(started.wait(), 5)
    await status_server.stop()
    assert cancelled.is_set()


async def test_failing_callbacks_do_not_break_the_server(calls: Calls, client: aiohttp.ClientSession) -> None:
    def on_quit() -> None:
        raise RuntimeError("bad callback")

    async def on_drain() -> None:
        raise RuntimeError("bad drain")

    status_server = build(calls, on_quit=on_quit, on_drain=on_drain)
    await status_server.start()
    try:
        assert (await fetch(client, "POST", url(status_server, "/quitquitquit")))[:2] == (200, "OK")
        assert (await fetch(client, "POST", url(status_server, "/drain")))[:2] == (200, "OK")
        assert (await fetch(client, "GET", url(status_server, "/healthz/ready")))[0] == 200
    finally:
        await status_server.stop()


# -- loopback-only access -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("::1%lo", True),
        ("10.0.0.1", False),
        ("192.0.2.2", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1", False),
        ("", False),
        (None, False),
        ("localhost", False),
    ],
)
def test_is_loopback(address: str | None, expected: bool) -> None:
    assert is_loopback(address) is expected


async def test_remote_callers_are_forbidden(calls: Calls, client: aiohttp.ClientSession) -> None:
    ip = non_loopback_ip()
    if ip is None:
        pytest.skip("no non-loopback local address (is_loopback is tested directly)")
    status_server = build(calls, host="0.0.0.0", metrics_localhost_only=True)
    await status_server.start()
    try:
        for method, path in (
            ("POST", "/quitquitquit"),
            ("GET", "/quitquitquit"),
            ("POST", "/drain"),
            ("GET", "/debug/ndsz"),
            ("GET", "/debug/secrets"),
            ("GET", "/metrics"),
            ("GET", "/stats/prometheus"),
        ):
            status, body, _ = await fetch(client, method, url(status_server, path, host=ip))
            assert (status, body) == (403, "Only requests from localhost are allowed\n"), path
        assert calls.quit == 0 and calls.metrics == []
        # the open endpoints still answer remote callers
        assert (await fetch(client, "GET", url(status_server, "/healthz/ready", host=ip)))[0] == 200
        assert (await fetch(client, "GET", url(status_server, "/app-health/a/livez", host=ip)))[0] == 200
        # and loopback callers get metrics
        assert (await fetch(client, "GET", url(status_server, "/metrics")))[0] == 200
        assert (await fetch(client, "POST", url(status_server, "/quitquitquit")))[:2] == (200, "OK")
        assert calls.quit == 1
    finally:
        await status_server.stop()


async def test_metrics_open_to_remote_callers_by_default(calls: Calls, client: aiohttp.ClientSession) -> None:
    ip = non_loopback_ip()
    if ip is None:
        pytest.skip("no non-loopback local address")
    status_server = build(calls, host="0.0.0.0")
    await status_server.start()
    try:
        assert (await fetch(client, "GET", url(status_server, "/metrics", host=ip)))[0] == 200
    finally:
        await status_server.stop()


# -- compression ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("header", "zstd", "expected"),
    [
        ("", True, None),
        ("gzip", True, "gzip"),
        ("zstd", True, "zstd"),
        ("zstd", False, None),
        ("gzip, zstd", True, "zstd"),
        ("gzip, zstd", False, "gzip"),
        ("gzip;q=1.0, zstd;q=0.5", True, "gzip"),
        ("GZIP;Q=0.2, zstd;q=0.1", True, "gzip"),
        ("br, lz4", True, None),
        ("deflate, br", True, None),
        ("gzip;q=0", True, None),
        ("gzip;q=bad", True, None),
        ("br;q=1, gzip;q=0.1", True, "gzip"),
    ],
)
def test_negotiate_encoding(header: str, zstd: bool, expected: str | None) -> None:
    assert negotiate_encoding(header, zstd=zstd) == expected


async def raw_get(
    server: StatusServer, path: str, accept_encoding: str | None
) -> tuple[int, bytes, str | None]:
    headers = {"Accept-Encoding": accept_encoding} if accept_encoding is not None else {}
    async with (
        aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=["Accept-Encoding"]) as session,
        session.get(url(server, path), headers=headers) as response,
    ):
        return response.status, await response.read(), response.headers.get("Content-Encoding")


async def test_large_bodies_are_gzipped_on_request(server: StatusServer, calls: Calls) -> None:
    calls.metrics_body = BIG
    status, body, encoding = await raw_get(server, "/stats/prometheus", "gzip")
    assert (status, encoding) == (200, "gzip")
    assert gzip.decompress(body).decode() == BIG
    status, body, encoding = await raw_get(server, "/stats/prometheus", "gzip;q=1.0, zstd;q=0.5")
    assert encoding == "gzip" and gzip.decompress(body).decode() == BIG


@pytest.mark.parametrize("accept", [None, "", "br, lz4", "gzip;q=0", "identity"])
async def test_no_acceptable_coding_is_left_plain(
    server: StatusServer, calls: Calls, accept: str | None
) -> None:
    calls.metrics_body = BIG
    status, body, encoding = await raw_get(server, "/stats/prometheus", accept)
    assert (status, body.decode(), encoding) == (200, BIG, None)


async def test_small_bodies_are_not_compressed(server: StatusServer, calls: Calls) -> None:
    calls.metrics_body = "m 1\n" * 10
    status, body, encoding = await raw_get(server, "/metrics", "gzip")
    assert (status, body.decode(), encoding) == (200, calls.metrics_body, None)


async def test_zstd_only_when_available(server: StatusServer, calls: Calls) -> None:
    calls.metrics_body = BIG
    _, body, encoding = await raw_get(server, "/metrics", "zstd")
    if negotiate_encoding("zstd") is None:
        assert (body.decode(), encoding) == (BIG, None)
    else:
        assert encoding == "zstd" and body != BIG.encode()


async def test_streamed_metrics_keep_working(calls: Calls) -> None:
    async def streamed(request: Request) -> StreamResponse:
        response = StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        for _ in range(5):
            await response.write(BIG.encode())
        await response.write_eof()
        return response

    status_server = build(calls, metrics=streamed)
    await status_server.start()
    try:
        status, body, encoding = await raw_get(status_server, "/stats/prometheus", "gzip")
        assert (status, body.decode(), encoding) == (200, BIG * 5, None)  # compression leaves it alone
    finally:
        await status_server.stop()


# -- lifecycle -------------------------------------------------------------------------------------------
async def test_close_listener_refuses_new_connections(calls: Calls, client: aiohttp.ClientSession) -> None:
    status_server = build(calls)
    await status_server.start()
    port = status_server.port
    assert (await fetch(client, "GET", url(status_server, "/healthz/ready")))[0] == 200
    await status_server.close_listener()
    try:
        with pytest.raises(ConnectionRefusedError):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    finally:
        await status_server.stop()
    await status_server.stop()  # idempotent


async def test_bind_failure_names_the_address(calls: Calls) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status_server = StatusServer("127.0.0.1", port, Readiness([]), registry=Registry())
        with pytest.raises(OSError, match=f"status server cannot listen on 127.0.0.1:{port}"):
            await status_server.start()
        await status_server.stop()  # nothing to stop, no error


async def test_start_twice_is_an_error(server: StatusServer) -> None:
    with pytest.raises(RuntimeError):
        await server.start()


# -- from the first moment (what the start-up server used to do, now the one server's job) -----------
async def exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


@pytest.mark.both_loops
async def test_readiness_is_answered_from_start_with_the_reason(calls: Calls) -> None:
    calls.prober.error = "config not received from XDS server (is Istiod running?)"
    status_server = build(calls)
    await status_server.start()
    try:
        port = status_server.port
        answer = await exchange(port, b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert answer.endswith(b"\r\n\r\nconfig not received from XDS server (is Istiod running?)\n")
        assert not status_server._readiness.became_ready.is_set()
        calls.prober.error = None
        answer = await exchange(
            port, b"HEAD /healthz/ready?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 0" in answer
        assert status_server._readiness.became_ready.is_set()
    finally:
        await status_server.stop()


@pytest.mark.both_loops
async def test_requests_in_pieces_are_answered_with_the_real_peer(calls: Calls) -> None:
    async def metrics(request: Request) -> StreamResponse:
        return Response(text=f"metrics for {request.remote}\n")

    quits: list[int] = []
    status_server = build(calls, metrics=metrics, on_quit=lambda: quits.append(1))
    await status_server.start()
    try:
        port = status_server.port
        # Sent in two pieces: the head is only complete with the second one.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stats/prometheus HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"Accept: text/plain\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"metrics for 127.0.0.1\n")
        quit_request = (
            b"POST /quitquitquit HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        assert (await exchange(port, quit_request)).startswith(b"HTTP/1.1 200 OK") and quits == [1]
    finally:
        await status_server.stop()


@pytest.mark.both_loops
async def test_an_endless_request_head_is_cut_off(calls: Calls) -> None:
    status_server = build(calls)
    await status_server.start()
    try:
        answer = await exchange(status_server.port, b"GET /healthz/ready HTTP/1.1\r\nX: " + b"a" * 100_000)
        assert answer.startswith(b"HTTP/1.1 431 ")  # refused and closed, not waited for
    finally:
        await status_server.stop()


@pytest.mark.both_loops
async def test_hostile_clients_are_answered_counted_and_cut_off_without_log_noise(
    calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()
    status_server = build(calls, limits=Limits(header_timeout=0.3), registry=registry)
    await status_server.start()
    port = status_server.port

    def rejected(reason: str) -> float:
        return registry.sample(PREFIX + "status_rejected_connections", {"reason": reason}) or 0.0

    try:
        with caplog.at_level(logging.DEBUG):
            answers = await asyncio.gather(
                *(exchange(port, b"\x16\x03\x01 not http\r\n\r\n") for _ in range(20))
            )
            assert all(answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") for answer in answers)
            assert rejected("malformed_request") == 20

            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
            closed = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in idle)), 5)
            assert closed == [b""] * 20  # closed by the server within the header deadline
            for _, writer in idle:
                writer.close()
            assert rejected("header_timeout") == 20
            assert (
                await exchange(port, b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            ).startswith(b"HTTP/1.1 200 OK")
        noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
        assert not noisy, [r.getMessage() for r in noisy]
        assert len([r for r in caplog.records if r.name == "istio.http"]) == 1
    finally:
        await status_server.stop()
