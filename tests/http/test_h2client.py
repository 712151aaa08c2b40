"""The probe HTTP/2 client against real h2 servers (the h2 package over asyncio) and grpcio."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from istio_agent.http import dial, h2client
from istio_agent.http.h2client import GrpcError, H2Error
from tests.http.h2server import H2Server, Handler, Reply, Seen, ok, tls_server_context

pytestmark = pytest.mark.timeout(20)

SOURCE = "127.0.0.6"


def from_source(family: int, kind: int, proto: int) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    if family == socket.AF_INET:
        sock.bind((SOURCE, 0))
    return sock


def client_tls(alpn: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(alpn)
    return context


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[H2Server]]]:
    started: list[H2Server] = []

    async def start(handler: Handler = ok, tls: ssl.SSLContext | None = None) -> H2Server:
        server = await H2Server(handler, tls).start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


def replying(reply: Reply) -> Handler:
    async def handler(seen: Seen) -> Reply:
        return reply

    return handler


async def get(server: H2Server, path: str = "/", **kwargs: object) -> h2client.Response:
    async with await h2client.open_connection("127.0.0.1", server.port) as conn:
        return await conn.request("GET", path, authority=f"127.0.0.1:{server.port}", **kwargs)  # type: ignore[arg-type]


# --- HTTP/2 requests -----------------------------------------------------------------------------


async def test_get_from_source_address(servers: Callable[..., Awaitable[H2Server]]) -> None:
    async def handler(seen: Seen) -> Reply:
        return Reply(status=503, headers=[("x-app", "a"), ("location", "/x")], body=b"down")

    server = await servers(handler)
    async with await h2client.open_connection("127.0.0.1", server.port, socket_factory=from_source) as conn:
        assert conn.alpn is None
        assert conn.peer == ("127.0.0.1", server.port)
        response = await conn.request(
            "GET",
            "/p?q=1",
            authority="app.example:80",
            headers=[
                ("X-Multi", "1"),
                ("X-Multi", "2"),
                ("Connection", "close"),
                ("Keep-Alive", "5"),
                ("Host", "ignored"),
                ("Transfer-Encoding", "chunked"),
                ("TE", "gzip"),
                ("User-Agent", "kube-probe/1.30"),
            ],
        )
    assert (response.status, response.body, response.truncated) == (503, b"down", False)
    assert response.header("X-App") == "a"
    assert response.header("location") == "/x"
    seen = server.seen[0]
    assert seen.peer == SOURCE
    assert seen.headers[:4] == [
        (":method", "GET"),
        (":scheme", "http"),
        (":authority", "app.example:80"),
        (":path", "/p?q=1"),
    ]
    assert seen.headers[4:] == [("x-multi", "1"), ("x-multi", "2"), ("user-agent", "kube-probe/1.30")]


async def test_tls_with_alpn(tmp_path: Path, servers: Callable[..., Awaitable[H2Server]]) -> None:
    server = await servers(tls=tls_server_context(tmp_path, ["h2"]))
    async with await h2client.open_connection(
        "127.0.0.1", server.port, tls=client_tls(["h2", "http/1.1"])
    ) as conn:
        assert conn.alpn == "h2"
        response = await conn.request("GET", "/", authority="app")
    assert response.body == b"hello"
    assert server.seen[0].header(":scheme") == "https"


async def test_large_body_needs_window_updates(servers: Callable[..., Awaitable[H2Server]]) -> None:
    big = bytes(range(256)) * 1000  # 256 000 bytes: several times the initial 65 535 window
    server = await servers(replying(Reply(body=big)))
    response = await get(server)
    assert response.body == big
    assert not response.truncated


@pytest.mark.parametrize(("size", "truncated"), [(9, False), (10, False), (11, True), (100_000, True)])
async def test_body_cap(servers: Callable[..., Awaitable[H2Server]], size: int, truncated: bool) -> None:
    server = await servers(replying(Reply(body=b"x" * size)))
    response = await get(server, max_body=10)
    assert response.body == b"x" * min(size, 10)
    assert response.truncated is truncated


async def test_trailers(servers: Callable[..., Awaitable[H2Server]]) -> None:
    server = await servers(replying(Reply(body=b"b", trailers=[("x-done", "yes")])))
    response = await get(server)
    assert response.trailer("x-done") == "yes"
    assert response.header("x-done") is None


async def test_post_body_arrives(servers: Callable[..., Awaitable[H2Server]]) -> None:
    server = await servers()
    async with await h2client.open_connection("127.0.0.1", server.port) as conn:
        await conn.request("POST", "/", authority="a", body=b"payload")
        with pytest.raises(H2Error, match="one request per connection"):
            await conn.request("GET", "/", authority="a")
    assert server.seen[0].body == b"payload"


async def test_body_beyond_flow_control_window_is_refused(
    servers: Callable[..., Awaitable[H2Server]],
) -> None:
    server = await servers()
    async with await h2client.open_connection("127.0.0.1", server.port) as conn:
        with pytest.raises(H2Error, match="flow-control window"):
            await conn.request("POST", "/", authority="a", body=b"x" * 70_000)


@pytest.mark.parametrize(("name", "message"), [("", "invalid request header name"), (":path", "header name")])
async def test_invalid_header_is_an_h2_error(
    servers: Callable[..., Awaitable[H2Server]], name: str, message: str
) -> None:
    server = await servers()
    async with await h2client.open_connection("127.0.0.1", server.port) as conn:
        with pytest.raises(H2Error, match=message):
            await conn.request("GET", "/", authority="a", headers=[(name, "v")])
    async with await h2client.open_connection("127.0.0.1", server.port) as conn:
        with pytest.raises(H2Error, match="invalid request: An empty :path"):
            await conn.request("GET", "", authority="a")


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(reset=True), "stream reset by the server .error code REFUSED_STREAM"),
        (Reply(goaway=True), "GOAWAY ENHANCE_YOUR_CALM"),
        (Reply(drop=True), "connection (closed|lost) before the response was complete"),
    ],
)
async def test_server_failures(
    servers: Callable[..., Awaitable[H2Server]], reply: Reply, message: str
) -> None:
    server = await servers(replying(reply))
    with pytest.raises(H2Error, match=message):
        await get(server)


async def test_http1_server_is_a_protocol_error() -> None:
    async def http1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http1, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        async with await h2client.open_connection("127.0.0.1", port) as conn:
            with pytest.raises(H2Error):
                await conn.request("GET", "/", authority="a")
    finally:
        server.close()
        await server.wait_closed()


async def test_connection_refused_is_os_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        await h2client.open_connection("127.0.0.1", port)


async def test_timeout_aborts_connection(servers: Callable[..., Awaitable[H2Server]]) -> None:
    server = await servers(replying(Reply(stall=True)))
    conn = await h2client.open_connection("127.0.0.1", server.port)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3), conn:
            await conn.request("GET", "/", authority="a")
    assert len(server.seen) == 1
    assert conn.stream.writer.transport.is_closing()  # aborted, not left open


async def test_dial_tries_every_address() -> None:
    # "localhost" may resolve to ::1 first: the dial moves on to an address that listens.
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        sock = await dial.connect("localhost", port, from_source)
        with contextlib.closing(sock):
            assert sock.getpeername()[:2] == ("127.0.0.1", port)
            assert sock.getsockname()[0] == SOURCE
    finally:
        server.close()
        await server.wait_closed()


# --- gRPC ----------------------------------------------------------------------------------------


@dataclass
class GrpcApp:
    port: int
    peers: list[str] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    remaining: list[float | None] = field(default_factory=list)


@pytest.fixture
async def grpc_app() -> AsyncIterator[GrpcApp]:
    app = GrpcApp(0)

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        app.peers.append(context.peer())
        app.agents.append(str(dict(context.invocation_metadata() or ()).get("user-agent", "")))
        app.remaining.append(context.time_remaining())
        if request == b"fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service: ü 100%")
        return b"re:" + request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    app.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield app
    await server.stop(None)


async def call(port: int, method: str, message: bytes, **kwargs: object) -> bytes:
    async with await h2client.open_connection("127.0.0.1", port, socket_factory=from_source) as conn:
        return await h2client.grpc_unary(conn, method, message, authority=f"127.0.0.1:{port}", **kwargs)  # type: ignore[arg-type]


async def test_grpc_unary_against_grpcio(grpc_app: GrpcApp) -> None:
    assert (
        await call(grpc_app.port, "/test.Echo/Say", b"hi", user_agent="kube-probe/1.30", timeout=7)
        == b"re:hi"
    )
    assert grpc_app.peers[0].startswith(f"ipv4:{SOURCE}:")
    assert grpc_app.agents[0].startswith("kube-probe/1.30")
    remaining = grpc_app.remaining[0]
    assert remaining is not None and 5 < remaining <= 7
    assert await call(grpc_app.port, "/test.Echo/Say", b"") == b"re:"
    assert grpc_app.remaining[1] is None


async def test_grpc_error_status_from_grpcio(grpc_app: GrpcApp) -> None:
    with pytest.raises(GrpcError) as caught:
        await call(grpc_app.port, "/test.Echo/Say", b"fail")
    assert (caught.value.code, caught.value.message) == (5, "unknown service: ü 100%")
    assert str(caught.value) == "rpc error: code = NotFound desc = unknown service: ü 100%"
    with pytest.raises(GrpcError) as missing:
        await call(grpc_app.port, "/test.Echo/Nope", b"")
    assert missing.value.code == h2client.UNIMPLEMENTED
    assert missing.value.code_name == "Unimplemented"


GRPC = [("content-type", "application/grpc")]


def frame(message: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(message).to_bytes(4, "big") + message


@pytest.mark.parametrize(
    ("reply", "code", "message"),
    [
        (
            Reply(
                headers=GRPC, trailers=[("grpc-status", "14"), ("grpc-message", "a%20b")], trailers_only=True
            ),
            14,
            "a b",
        ),
        (Reply(status=404), 12, "unexpected HTTP status code received from server: 404"),
        (Reply(status=503, headers=GRPC), 14, "unexpected HTTP status code received from server: 503"),
        (Reply(status=500), 2, "unexpected HTTP status code received from server: 500"),
        (
            Reply(headers=[("content-type", "text/html")], body=b"<p>"),
            2,
            "unexpected content-type 'text/html'",
        ),
        (Reply(headers=GRPC, body=frame(b"x")), 13, "server closed the stream without sending trailers"),
        (Reply(headers=GRPC, trailers=[("grpc-status", "OK")]), 2, "invalid grpc-status 'OK'"),
        (Reply(headers=GRPC, trailers=[("grpc-status", "0")]), 13, "no response message"),
        (
            Reply(headers=GRPC, body=frame(b"x", 1), trailers=[("grpc-status", "0")]),
            13,
            "compressed response",
        ),
        (Reply(headers=GRPC, body=frame(b"xy")[:-1], trailers=[("grpc-status", "0")]), 13, "malformed"),
        (
            Reply(headers=GRPC, body=frame(b"x" * 11), trailers=[("grpc-status", "0")]),
            8,
            "response larger than 10 bytes",
        ),
        (Reply(headers=GRPC, trailers=[("grpc-status", "99")], trailers_only=True), 99, ""),
    ],
)
async def test_grpc_failures(
    servers: Callable[..., Awaitable[H2Server]], reply: Reply, code: int, message: str
) -> None:
    server = await servers(replying(reply))
    with pytest.raises(GrpcError) as caught:
        await call(server.port, "/test.Echo/Say", b"", max_message=10)
    assert caught.value.code == code
    assert caught.value.message.startswith(message)


async def test_grpc_request_framing(servers: Callable[..., Awaitable[H2Server]]) -> None:
    server = await servers(
        replying(Reply(headers=GRPC, body=frame(b"y" * 10), trailers=[("grpc-status", "0")]))
    )
    assert await call(server.port, "/pkg.Svc/M", b"abc", timeout=0.0001, max_message=10) == b"y" * 10
    seen = server.seen[0]
    assert seen.body == frame(b"abc")
    assert seen.header(":method") == "POST"
    assert seen.header(":path") == "/pkg.Svc/M"
    assert seen.header("content-type") == "application/grpc"
    assert seen.header("te") == "trailers"
    assert seen.header("grpc-timeout") == "1m"
    assert seen.header("user-agent") is None
    assert str(GrpcError(42, "x")) == "rpc error: code = Code(42) desc = x"


async def test_an_answered_request_does_not_wait_for_the_servers_tls_shutdown(tmp_path: Path) -> None:
    """An app that answers, then neither reads nor closes: the probe has its answer and must not time out."""
    context = tls_server_context(tmp_path, ["h2"])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    release = threading.Event()

    def serve() -> None:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True) as tls:
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            tls.sendall(conn.data_to_send())
            answered = False
            while not answered:
                for event in conn.receive_data(tls.recv(65536)):
                    if isinstance(event, h2.events.RequestReceived):
                        conn.send_headers(event.stream_id, [(":status", "200")])
                        conn.send_data(event.stream_id, b"ok", end_stream=True)
                        answered = True
                tls.sendall(conn.data_to_send())
            release.wait(10)  # never reads the GOAWAY or the close_notify

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        async with asyncio.timeout(3):
            connection = await h2client.open_connection(
                "127.0.0.1", listener.getsockname()[1], tls=client_tls(["h2", "http/1.1"])
            )
            async with connection as conn:
                response = await conn.request("GET", "/", authority="app", max_body=100)
        assert (response.status, response.body) == (200, b"ok")
    finally:
        release.set()
        thread.join(5)
        listener.close()
