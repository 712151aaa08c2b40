"""The HTTP/1.1 server over real sockets, on asyncio's loop and on uvloop: framing, limits, shutdown."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from istio_agent.http.listen import listening_socket
from istio_agent.http.messages import Request, Response, StreamResponse
from istio_agent.http.server import (
    CONNECTION_LIMIT,
    HEADER_TIMEOUT,
    MALFORMED,
    ClientDisconnected,
    Limits,
    ServerRunner,
    SockSite,
    TCPSite,
)

pytestmark = [pytest.mark.both_loops, pytest.mark.timeout(20)]

Serve = Callable[..., Awaitable[int]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start a server for a handler on 127.0.0.1; returns its port. Cleaned up after the test."""
    runners: list[ServerRunner] = []

    async def start(handler: Callable[[Request], Awaitable[StreamResponse]], **kwargs: object) -> int:
        runner = ServerRunner(handler, **kwargs)  # type: ignore[arg-type]
        site = TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return site.port

    yield start
    for runner in runners:
        await runner.cleanup(timeout=1)


async def hello(request: Request) -> StreamResponse:
    return Response(text=f"hello {request.remote}")


async def raw(port: int, data: bytes, *, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5) if read_until_close else b""
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One Content-Length response: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


# --- requests and responses -----------------------------------------------------------------------


async def test_get_with_an_independent_client(serve: Serve) -> None:
    port = await serve(hello)
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/x") as response:
        assert response.status == 200
        assert response.reason == "OK"
        assert await response.text() == "hello 127.0.0.1"
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert response.headers["Content-Length"] == str(len("hello 127.0.0.1"))
        assert "GMT" in response.headers["Date"]


async def test_request_fields() -> None:
    request = Request("GET", "/a%20b/c?x=1&y=&x=2", [("Host", "h"), ("X-Multi", "1"), ("x-multi", "2")])
    assert (request.path, request.raw_path, request.query_string) == ("/a b/c", "/a%20b/c", "x=1&y=&x=2")
    assert request.query == {"x": "1", "y": ""}
    assert request.headers.getall("X-MULTI") == ["1", "2"]
    assert request.remote is None
    absolute = Request("GET", "http://example.com/p?q=1")
    assert (absolute.path, absolute.query_string) == ("/p", "q=1")
    assert await request.read() == b""  # no connection: no body


async def test_headers_keep_their_case_and_order(serve: Serve) -> None:
    seen: list[list[tuple[str, str]]] = []

    async def handler(request: Request) -> StreamResponse:
        seen.append(request.headers.items())
        return Response(headers=[("X-Reply", "a"), ("x-reply", "b")])

    port = await serve(handler)
    answer = await raw(
        port, b"GET / HTTP/1.1\r\nHost: h\r\nX-Custom: 1\r\nx-custom: 2\r\nConnection: close\r\n\r\n"
    )
    assert seen[0] == [("Host", "h"), ("X-Custom", "1"), ("x-custom", "2"), ("Connection", "close")]
    assert b"\r\nX-Reply: a\r\nx-reply: b\r\n" in answer


async def test_keep_alive_and_pipelining(serve: Serve) -> None:
    paths: list[str] = []

    async def handler(request: Request) -> StreamResponse:
        paths.append(request.path)
        return Response(text=request.path)

    port = await serve(handler)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /one HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await read_response(reader))[1] == b"/one"
        # two requests in one write: answered in order on the same connection
        writer.write(
            b"GET /two HTTP/1.1\r\nHost: h\r\n\r\nGET /three HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        )
        assert (await read_response(reader))[1] == b"/two"
        head, body = await read_response(reader)
        assert body == b"/three" and b"Connection: close" in head
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the Connection: close request
    finally:
        writer.close()
    assert paths == ["/one", "/two", "/three"]


async def test_head_has_get_headers_and_no_body(serve: Serve) -> None:
    port = await serve(hello)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 15\r\n" in head
        # no body followed: the next bytes are the GET's answer
        head, body = await read_response(reader)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b"hello 127.0.0.1"
    finally:
        writer.close()


async def test_streamed_responses_chunked_and_with_length(serve: Serve) -> None:
    async def handler(request: Request) -> StreamResponse:
        headers = {"Content-Length": "6"} if request.path == "/length" else None
        response = StreamResponse(headers=headers, content_type="text/plain")
        await response.prepare(request)
        await response.write(b"abc")
        await response.write(b"")
        await response.write(b"def")
        await response.write_eof()
        return response

    port = await serve(handler)
    chunked = await raw(port, b"GET /chunked HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert b"Transfer-Encoding: chunked\r\n" in chunked
    assert chunked.endswith(b"\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n")
    sized = await raw(port, b"GET /length HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert b"Content-Length: 6\r\n" in sized and sized.endswith(b"\r\n\r\nabcdef")
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/chunked") as response,
    ):
        assert await response.read() == b"abcdef"


async def test_http10_client_gets_a_body_until_close(serve: Serve) -> None:
    async def handler(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        await response.write(b"streamed")
        return response  # not ended by the handler: the server ends it

    port = await serve(handler)
    answer = await raw(port, b"GET / HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nstreamed")
    assert b"Connection: close" in answer


async def test_request_body_and_100_continue(serve: Serve) -> None:
    async def echo(request: Request) -> StreamResponse:
        return Response(body=await request.read())

    port = await serve(echo)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 \r\n\r\n"
        writer.write(b"body")
        assert (await read_response(reader))[1] == b"body"
        writer.write(
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n"
        )
        assert (await read_response(reader))[1] == b"abc"
    finally:
        writer.close()


async def test_expect_100_without_reading_answers_and_closes(serve: Serve) -> None:
    port = await serve(hello)
    answer = await raw(
        port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in answer
    assert b" 100 " not in answer


async def test_unread_body_is_skipped_on_a_kept_alive_connection(serve: Serve) -> None:
    port = await serve(hello)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nxxxxxGET / HTTP/1.1\r\nHost: h\r\n\r\n"
        )
        assert (await read_response(reader))[1] == b"hello 127.0.0.1"
        assert (await read_response(reader))[1] == b"hello 127.0.0.1"
    finally:
        writer.close()


# --- malformed input and limits -----------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
        + b"\x00" * 40
        + b"\r\n\r\n",  # TLS to a plaintext port
    ],
)
async def test_malformed_requests_get_400_and_no_traceback(
    serve: Serve, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    port = await serve(hello)
    with caplog.at_level(logging.DEBUG):
        answer = await raw(port, request_bytes)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:80]
    assert b"Connection: close\r\n" in answer and answer.endswith(b"400 Bad Request\n")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_bad_requests_are_counted_and_logged_on_one_debug_line(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    rejected: list[str] = []
    port = await serve(hello, on_reject=rejected.append)
    # The scope's own level: a test before this one in the worker may have configured istio's levels.
    with caplog.at_level(logging.DEBUG, logger="istio.http"):
        answers = await asyncio.gather(*(raw(port, b"GARBAGE " * 2000 + b"\r\n\r\n") for _ in range(200)))
    assert all(answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") for answer in answers)
    assert rejected == [MALFORMED] * 200
    lines = [r for r in caplog.records if r.name == "istio.http"]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG and not lines[0].exc_info
    assert len(lines[0].getMessage()) < 300  # the offending bytes are not copied into the log


async def open_silent(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_silent_and_trickling_connections_are_closed_after_the_header_timeout(serve: Serve) -> None:
    rejected: list[str] = []
    port = await serve(hello, limits=Limits(header_timeout=0.3), on_reject=rejected.append)
    silent = await open_silent(port, 50)
    trickling_reader, trickling = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        for byte in b"GET / HTTP/1.1\r\nHost: h\r\n":
            if trickling.is_closing():
                return
            trickling.write(bytes([byte]))
            await asyncio.sleep(0.05)

    feeder = asyncio.ensure_future(trickle())
    try:
        assert all(await asyncio.gather(*(closed_within(reader, 3) for reader, _ in silent)))
        assert await closed_within(trickling_reader, 3)
        assert rejected == [HEADER_TIMEOUT] * 51
    finally:
        feeder.cancel()
        for _, writer in [*silent, (trickling_reader, trickling)]:
            writer.close()


async def test_a_kept_alive_connection_may_idle_but_its_next_head_is_bounded(serve: Serve) -> None:
    rejected: list[str] = []
    port = await serve(
        hello, limits=Limits(header_timeout=0.2, keepalive_timeout=5), on_reject=rejected.append
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(2):
            writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            await read_response(reader)
            await asyncio.sleep(0.5)  # idle longer than the header timeout: still open
        writer.write(b"GET / HTTP/1.1\r\n")  # a head begun and never finished
        assert await closed_within(reader, 3)
        assert rejected == [HEADER_TIMEOUT]
    finally:
        writer.close()


async def half_open(port: int, n: int, host: str) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``n`` connections from ``host`` that each send half a request head and stop (slowloris)."""
    held = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
        writer.write(b"GET /healthz/ready HTTP/1.1\r\nHo")
        held.append((reader, writer))
    return held


async def probe(port: int) -> bytes:
    """A kubelet-style probe: one request on a new connection, Connection: close."""
    try:
        return await raw(port, b"GET /healthz/ready HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    except ConnectionError:
        return b""


async def test_a_flood_of_half_open_connections_does_not_lock_probes_out(serve: Serve) -> None:
    """Issue 20: a neighbour holding the connection cap with half-sent heads made the pod unready."""
    rejected: list[str] = []
    port = await serve(hello, limits=Limits(max_connections=16), on_reject=rejected.append)
    kept_reader, kept = await asyncio.open_connection("127.0.0.1", port)  # e.g. Prometheus, kept alive
    kept.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    await read_response(kept_reader)
    flood = await half_open(port, 20, "127.0.0.2")
    try:
        answers = []
        for _ in range(20):
            flood += await half_open(port, 3, "127.0.0.2")  # the flood goes on between probes
            answers.append(await probe(port))
        assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)
        assert set(rejected) == {CONNECTION_LIMIT}
        kept.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")  # the other peer's idle one was spared
        head, _ = await read_response(kept_reader)
        assert head.startswith(b"HTTP/1.1 200 ")
        still_open = [r for r, _ in flood if not await closed_within(r, 0.01)]
        assert len(still_open) <= 15  # the flooder's oldest connections were the ones closed
        assert not await closed_within(flood[-1][0], 0.01)
    finally:
        kept.close()
        for _, writer in flood:
            writer.close()


async def test_connections_beyond_the_limit_are_closed_at_once_when_all_are_in_requests(
    serve: Serve,
) -> None:
    rejected: list[str] = []
    release = asyncio.Event()

    async def slow(request: Request) -> StreamResponse:
        await release.wait()
        return Response(text="done")

    port = await serve(slow, limits=Limits(max_connections=3), on_reject=rejected.append)
    busy = await open_silent(port, 3)
    for _, writer in busy:
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    await asyncio.sleep(0.1)
    (extra_reader, extra_writer), *_ = await open_silent(port, 1)
    try:
        assert await closed_within(extra_reader, 3)
        assert rejected == [CONNECTION_LIMIT]
        release.set()
        for reader, _ in busy:  # the requests in flight were not disturbed
            head, body = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200 ") and body == b"done"
    finally:
        extra_writer.close()
        for _, writer in busy:
            writer.close()


async def test_other_http_versions_are_505(serve: Serve) -> None:
    port = await serve(hello)
    answer = await raw(port, b"GET / HTTP/2.0\r\nHost: h\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n")


async def test_a_malformed_chunked_body_is_400(serve: Serve) -> None:
    async def echo(request: Request) -> StreamResponse:
        return Response(body=await request.read())

    port = await serve(echo)
    answer = await raw(port, b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ")


async def test_head_too_large_is_431(serve: Serve) -> None:
    port = await serve(hello, limits=Limits(max_head=1024))
    answer = await raw(port, b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 2000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    endless = await raw(port, b"GET / HTTP/1.1\r\nX: " + b"a" * 20000)  # never completes
    assert endless.startswith(b"HTTP/1.1 431 ")


async def test_body_too_large_is_413(serve: Serve) -> None:
    async def echo(request: Request) -> StreamResponse:
        return Response(body=await request.read())

    port = await serve(echo, limits=Limits(max_body=10))
    ok = await raw(
        port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\nConnection: close\r\n\r\n0123456789"
    )
    assert ok.endswith(b"\r\n\r\n0123456789")
    answer = await raw(port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 11\r\n\r\n0123456789X")
    assert answer.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n") and b"Connection: close" in answer


async def test_a_failing_handler_is_500_logged_once_and_the_server_goes_on(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(request: Request) -> StreamResponse:
        if request.path == "/bug":
            raise RuntimeError("a bug")
        return Response(text="fine")

    port = await serve(broken)
    with caplog.at_level(logging.ERROR):
        answer = await raw(port, b"GET /bug HTTP/1.1\r\nHost: h\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and "GET /bug" in errors[0].getMessage()
    assert (await raw(port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")).endswith(b"fine")


async def test_a_failure_mid_stream_drops_the_connection(serve: Serve) -> None:
    async def half(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        await response.write(b"partial")
        raise RuntimeError("broke mid-body")

    port = await serve(half)
    answer = await raw(port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert answer.endswith(b"7\r\npartial\r\n")  # no terminating chunk: the client sees the body cut


# --- back-pressure and disconnects --------------------------------------------------------------


async def test_writes_wait_for_a_slow_client(serve: Serve) -> None:
    written = 0
    done = asyncio.Event()
    piece = b"x" * 65536

    async def big(request: Request) -> StreamResponse:
        nonlocal written
        response = StreamResponse()
        await response.prepare(request)
        for _ in range(1024):  # 64 MiB
            await response.write(piece)
            written += len(piece)
        await response.write_eof()
        done.set()
        return response

    port = await serve(big)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**16)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        await asyncio.sleep(0.5)
        assert written < 32 * 2**20  # held back by the client not reading
        received = 0
        while chunk := await asyncio.wait_for(reader.read(2**20), 5):
            received += len(chunk)
        assert done.is_set() and received > 64 * 2**20
    finally:
        writer.close()


async def test_a_client_hanging_up_mid_stream_ends_the_handler_quietly(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    stopped: list[BaseException] = []

    async def endless(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"y" * 65536)
        except ClientDisconnected as err:
            stopped.append(err)
            raise

    port = await serve(endless)
    with caplog.at_level(logging.WARNING):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        await reader.readexactly(100000)
        writer.transport.abort()
        async with asyncio.timeout(5):
            while not stopped:
                await asyncio.sleep(0.01)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- lifecycle ------------------------------------------------------------------------------------


async def test_idle_connections_close_after_the_keepalive_timeout(serve: Serve) -> None:
    port = await serve(hello, limits=Limits(keepalive_timeout=0.2))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        await read_response(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_graceful_shutdown(serve: Serve) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(request: Request) -> StreamResponse:
        if request.path == "/slow":
            started.set()
            await release.wait()
        return Response(text=request.path)

    runner = ServerRunner(slow, shutdown_timeout=5)
    site = TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site.port
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    idle_writer.write(b"GET /idle HTTP/1.1\r\nHost: h\r\n\r\n")
    await read_response(idle_reader)
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
    busy_writer.write(b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
    await asyncio.wait_for(started.wait(), 5)

    cleanup = asyncio.ensure_future(runner.cleanup())
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # the idle one closes at once
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert not cleanup.done()
    release.set()
    head, body = await read_response(busy_reader)  # the one in flight finishes, then closes
    assert body == b"/slow" and b"Connection: close" in head
    await asyncio.wait_for(cleanup, 5)
    assert runner.connections == 0
    idle_writer.close()
    busy_writer.close()


async def test_shutdown_is_bounded(serve: Serve) -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def forever(request: Request) -> StreamResponse:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    runner = ServerRunner(forever)
    site = TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    _, writer = await asyncio.open_connection("127.0.0.1", site.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    await asyncio.wait_for(started.wait(), 5)
    loop = asyncio.get_running_loop()
    begun = loop.time()
    await runner.cleanup(timeout=0.2)
    assert loop.time() - begun < 2 and cancelled.is_set()
    writer.close()


async def test_sock_site_serves_an_existing_socket() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    runner = ServerRunner(hello)
    site = SockSite(runner, sock)
    await site.start()
    try:
        assert site.port == sock.getsockname()[1]
        answer = await raw(site.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert answer.endswith(b"hello 127.0.0.1")
        with pytest.raises(RuntimeError):
            await site.start()
    finally:
        await runner.cleanup()
    assert site.port == 0 and runner.sites == []


async def test_a_listening_socket_queues_connections_until_served() -> None:
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # accepted by the kernel already
    writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    runner = ServerRunner(hello)
    await SockSite(runner, sock).start()  # served later: the request waited in the backlog
    try:
        assert (await asyncio.wait_for(reader.read(), 5)).endswith(b"hello 127.0.0.1")
    finally:
        writer.close()
        await runner.cleanup()


def test_a_port_in_use_is_named() -> None:
    taken = listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:\d+: Address already in use"):
            listening_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


@pytest.mark.parametrize("seconds", [0, 784111777, 951782400, 1_700_000_000, 2_000_000_000.9, 4_102_444_799])
def test_http_date_is_the_imf_fixdate_the_email_package_writes(seconds: float) -> None:
    from email.utils import formatdate

    from istio_agent.http.server import format_http_date

    assert format_http_date(seconds) == formatdate(int(seconds), usegmt=True)
