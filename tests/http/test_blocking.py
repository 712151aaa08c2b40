"""The blocking one-request client against an independent server (aiohttp) and scripted raw answers.

The servers run on the test's event loop, so each blocking call runs on a thread.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from istio_agent.http import blocking
from istio_agent.http.exchange import BodyTooLarge, ConnectError, Fetched, ProtocolError
from tests.http.aioserver import Serve, aio_fixture  # noqa: F401  (the "aio" fixture)
from tests.http.h2server import tls_server_context
from tests.http.scripted import Scripted, scripted_fixture  # noqa: F401  (the "scripted" fixture)
from tests.http.test_client import closed_port

pytestmark = pytest.mark.timeout(20)


async def fetch(url: str, *, seconds: float = 5, **kwargs: Any) -> Fetched:
    deadline = time.monotonic() + seconds
    return await asyncio.to_thread(blocking.fetch, "GET", url, deadline=deadline, **kwargs)


async def test_get_with_headers_and_status(aio: Serve) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            status=404,
            text=f"{request.path_qs} {request.headers['Authorization']} {request.headers['Host']}",
            headers={"X-Answer": "yes"},
        )

    port = await aio(handler)
    got = await fetch(f"http://127.0.0.1:{port}/api/v1/x?y=1", headers={"Authorization": "Bearer t"})
    assert (got.status, got.reason, got.headers["X-Answer"]) == (404, "Not Found", "yes")
    assert got.body == f"/api/v1/x?y=1 Bearer t 127.0.0.1:{port}".encode()


async def test_body_cap_chunked_and_informational(aio: Serve, scripted: Scripted) -> None:
    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(10):
            await response.write(b"x" * 100)
        return response

    port = await aio(big)
    assert len((await fetch(f"http://127.0.0.1:{port}/", max_body=1000)).body) == 1000
    with pytest.raises(BodyTooLarge, match="exceeds the 999 byte cap"):
        await fetch(f"http://127.0.0.1:{port}/", max_body=999)
    port, _ = await scripted(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Nope\r\n\r\n" + b"y" * 200_000)
    got = await fetch(f"http://127.0.0.1:{port}/")
    assert (got.status, len(got.body)) == (503, 200_000)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"garbage\r\n\r\n", "malformed response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "received 5 bytes, expected 10"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "response head larger than 65536 bytes"),
        (b"", "malformed response"),
    ],
)
async def test_malformed_answers_are_protocol_errors(scripted: Scripted, answer: bytes, message: str) -> None:
    port, _ = await scripted(answer)
    with pytest.raises(ProtocolError, match=message):
        await fetch(f"http://127.0.0.1:{port}/")


async def test_connect_errors_and_the_deadline(scripted: Scripted) -> None:
    port = closed_port()
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{port}: Connection refused"):
        await fetch(f"http://127.0.0.1:{port}/")
    with pytest.raises(ConnectError) as unknown:
        await fetch("http://no-such-host.invalid/")
    assert isinstance(unknown.value.os_error, socket.gaierror)
    silent, _ = await scripted(None)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await fetch(f"http://127.0.0.1:{silent}/", seconds=0.3)
    assert time.monotonic() - started < 2
    with pytest.raises(TimeoutError):
        blocking.fetch("GET", f"http://127.0.0.1:{silent}/", deadline=time.monotonic() - 1)


async def test_https_verified_by_the_given_context_only(aio: Serve, tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=f"tls {request.secure}")

    port = await aio(handler, ssl_context=tls_server_context(tmp_path, ["http/1.1"]))
    trusting = ssl.create_default_context()
    trusting.check_hostname = False
    trusting.verify_mode = ssl.CERT_NONE
    assert (await fetch(f"https://127.0.0.1:{port}/", tls=trusting)).body == b"tls True"
    with pytest.raises(ConnectError) as failed:  # verified by default: a test CA is not trusted
        await fetch(f"https://127.0.0.1:{port}/")
    assert isinstance(failed.value.os_error, ssl.SSLError)


def test_importing_it_does_not_import_asyncio() -> None:
    """The point of this client: a short-lived process pays for no event loop."""
    import subprocess

    code = "import sys, istio_agent.http.blocking; print('asyncio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"
