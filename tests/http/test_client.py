"""The HTTP/1.1 client against an independent server (aiohttp) and scripted raw answers."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import pytest
from aiohttp import web

from istio_agent.http import dial
from istio_agent.http.client import (
    URL,
    BodyTooLarge,
    Client,
    ConnectError,
    HTTPError,
    ProtocolError,
    fetch,
)
from tests.http.aioserver import Serve, aio_fixture  # noqa: F401  (the "aio" fixture)
from tests.http.h2server import tls_server_context
from tests.http.scripted import Scripted, scripted_fixture  # noqa: F401  (the "scripted" fixture)

pytestmark = pytest.mark.timeout(20)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- URLs -----------------------------------------------------------------------------------------


def test_url_parsing() -> None:
    url = URL.parse("http://127.0.0.1:8080/stats?filter=a%5E&usedonly")
    assert (url.host, url.port, url.target, url.authority) == (
        "127.0.0.1",
        8080,
        "/stats?filter=a%5E&usedonly",
        "127.0.0.1:8080",
    )
    assert URL.parse("https://[::1]/x").authority == "[::1]"
    assert URL.parse("https://[::1]/x").address == "[::1]:443"
    assert URL.parse("http://h").target == "/"
    assert str(URL.parse("http://h:80/a").join("../b?c")) == "http://h/b?c"
    assert URL.parse("http://h:1/a").join("https://o/p") == URL("https", "o", 443, "/p")
    for bad in ("ftp://h/", "http:///x", "http://h:99999/", "nonsense"):
        with pytest.raises(HTTPError, match="invalid URL"):
            URL.parse(bad)


# --- requests -------------------------------------------------------------------------------------


async def test_get_and_post_against_aiohttp(aio: Serve) -> None:
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.path_qs, dict(request.headers), await request.read()))
        return web.Response(text="answer", headers={"X-A": "1"})

    port = await aio(handler)
    got = await fetch("GET", f"http://127.0.0.1:{port}/p?q=%41", headers=[("X-Case", "Kept")], timeout=5)
    assert (got.status, got.reason, got.body, got.text()) == (200, "OK", b"answer", "answer")
    assert got.headers["x-a"] == "1"
    method, target, headers, body = seen[0]
    assert (method, target, body) == ("GET", "/p?q=%41", b"")
    assert headers["Host"] == f"127.0.0.1:{port}" and headers["X-Case"] == "Kept"
    assert headers["Connection"] == "close"  # no pool: the server may close first
    posted = await fetch("POST", f"http://127.0.0.1:{port}/drain", timeout=5)
    assert posted.status == 200 and seen[1][2]["Content-Length"] == "0"
    await fetch("PUT", f"http://127.0.0.1:{port}/x", body=b"data", timeout=5)
    assert seen[2][3] == b"data"


async def test_host_header_first_and_not_doubled(
    scripted: Scripted,
) -> None:
    port, heads = await scripted(b"HTTP/1.1 204 No Content\r\n\r\n")
    await fetch("GET", f"http://127.0.0.1:{port}/a", timeout=5)
    assert heads[0].startswith(b"GET /a HTTP/1.1\r\nHost: 127.0.0.1:")
    await fetch("GET", f"http://127.0.0.1:{port}/a", headers={"host": "app.example:1"}, timeout=5)
    assert heads[1].count(b"ost:") == 1 and b"\r\nhost: app.example:1\r\n" in heads[1]


async def test_streamed_and_chunked_bodies(aio: Serve) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for piece in (b"one ", b"two ", b"three"):
            await response.write(piece)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    port = await aio(chunked)
    client = Client()
    async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
        assert response.headers["Transfer-Encoding"] == "chunked" and response.content_length is None
        pieces = []
        while piece := await response.read_chunk():
            pieces.append(piece)
        assert b"".join(pieces) == b"one two three" and len(pieces) >= 2
        assert response.complete


async def test_body_caps(aio: Serve) -> None:
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 1000)

    port = await aio(big)
    client = Client()
    with pytest.raises(BodyTooLarge, match="1000 bytes exceeds the 999 byte cap"):
        await client.fetch("GET", f"http://127.0.0.1:{port}/", max_body=999)
    cut = await client.fetch("GET", f"http://127.0.0.1:{port}/", max_body=10, truncate=True)
    assert (cut.body, cut.truncated) == (b"x" * 10, True)
    whole = await client.fetch("GET", f"http://127.0.0.1:{port}/", max_body=1000, truncate=True)
    assert (len(whole.body), whole.truncated) == (1000, False)


async def test_read_buffer_hands_over_the_gathered_body_without_a_copy(aio: Serve) -> None:
    """``read_buffer`` (for Wasm modules) is ``read`` without the final copy into ``bytes``: the same
    body, caps and truncation, in the bytearray it was gathered in."""

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 1000)

    port = await aio(big)
    client = Client()
    async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
        body = await response.read_buffer(None)
    assert type(body) is bytearray and body == bytes(range(256)) * 1000
    async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
        with pytest.raises(BodyTooLarge):
            await response.read_buffer(255_999)
    async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
        cut = await response.read_buffer(300, truncate=True)
    assert (bytes(cut), response.truncated) == ((bytes(range(256)) * 2)[:300], True)
    async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
        assert type(await response.read(None)) is bytes


async def test_body_until_close_and_informational_answers(
    scripted: Scripted,
) -> None:
    port, _ = await scripted(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\n\r\n" + b"y" * 200_000
    )
    got = await fetch("GET", f"http://127.0.0.1:{port}/", timeout=5)
    assert (got.status, len(got.body)) == (503, 200_000)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"garbage\r\n\r\n", "malformed response"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "received 5 bytes, expected 10"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "response head larger than 65536 bytes"),
        (b"", "malformed response"),
    ],
)
async def test_malformed_answers_are_protocol_errors(scripted: Scripted, answer: bytes, message: str) -> None:
    port, _ = await scripted(answer)
    with pytest.raises(ProtocolError, match=message):
        await fetch("GET", f"http://127.0.0.1:{port}/", timeout=5)


async def test_connect_errors_carry_the_os_error() -> None:
    port = closed_port()
    with pytest.raises(ConnectError) as refused:
        await fetch("GET", f"http://127.0.0.1:{port}/", timeout=5)
    assert isinstance(refused.value.os_error, ConnectionRefusedError)
    assert str(refused.value) == f"cannot connect to 127.0.0.1:{port}: Connection refused"
    with pytest.raises(ConnectError) as unknown:
        await fetch("GET", "http://no-such-host.invalid/", timeout=5)
    assert isinstance(unknown.value.os_error, socket.gaierror)


async def test_timeout_aborts(aio: Serve) -> None:
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    port = await aio(hang)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await fetch("GET", f"http://127.0.0.1:{port}/", timeout=0.2)
    assert loop.time() - started < 2
    release.set()


# --- keep-alive -----------------------------------------------------------------------------------


async def test_keepalive_pool_reuses_connections(aio: Serve) -> None:
    peers: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.Response(text="ok")

    port = await aio(handler)
    client = Client(keepalive=True)
    try:
        for _ in range(3):
            got = await client.fetch("GET", f"http://127.0.0.1:{port}/")
            assert got.body == b"ok"
        assert len(set(peers)) == 1
    finally:
        await client.aclose()
    one_shot = Client()
    for _ in range(2):
        await one_shot.fetch("GET", f"http://127.0.0.1:{port}/")
    assert len(set(peers)) == 3


async def test_a_pooled_connection_the_server_closed_is_replaced() -> None:
    answered = 0

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        await reader.readuntil(b"\r\n\r\n")
        answered += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # keep-alive, then closes anyway
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_server(once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Client(keepalive=True)
    try:
        assert (await client.fetch("GET", f"http://127.0.0.1:{port}/")).body == b"ok"
        await asyncio.sleep(0.2)
        assert (await client.fetch("GET", f"http://127.0.0.1:{port}/")).body == b"ok"
        assert answered == 2
    finally:
        await client.aclose()
        server.close()


# --- dialing: source address, TLS, the transport seam ----------------------------------------------


async def test_socket_factory_sets_the_source_address(aio: Serve) -> None:
    remotes: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        remotes.append(request.remote)
        return web.Response()

    def from_127_0_0_6(family: int, kind: int, proto: int) -> socket.socket:
        sock = socket.socket(family, kind, proto)
        sock.bind(("127.0.0.6", 0))
        return sock

    port = await aio(handler)
    await fetch("GET", f"http://127.0.0.1:{port}/", socket_factory=from_127_0_0_6, timeout=5)
    assert remotes == ["127.0.0.6"]


async def test_https_with_alpn_and_unverified_certificates(aio: Serve, tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=f"tls {request.secure}")

    port = await aio(handler, ssl_context=tls_server_context(tmp_path, ["http/1.1"]))
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    got = await fetch("GET", f"https://127.0.0.1:{port}/", tls=context, timeout=5)
    assert got.body == b"tls True"
    with pytest.raises(ConnectError) as failed:  # verified by default: a test CA is not trusted
        await fetch("GET", f"https://127.0.0.1:{port}/", timeout=5)
    assert isinstance(failed.value.os_error, ssl.SSLError)


async def test_a_connector_replaces_dialing(aio: Serve) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=request.host)

    port = await aio(handler)
    dialed: list[URL] = []

    async def connector(url: URL) -> dial.Stream:
        dialed.append(url)
        return await dial.open_stream("127.0.0.1", port)

    got = await Client(connector=connector).fetch("GET", "http://app.example/x")
    assert got.body == b"app.example"
    assert dialed == [URL("http", "app.example", 80, "/x")]
