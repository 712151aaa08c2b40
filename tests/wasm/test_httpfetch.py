"""The HTTP(S) Wasm fetcher against a real local server (aiohttp, independent of our client).

Cases from Istio's ``pkg/wasm/httpfetcher_test.go`` and ``ssrf_test.go`` (HEAD), plus where we
differ: an oversize module is refused rather than truncated, a gzip bomb and a gzip quine stop.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import ipaddress
import ssl
import tarfile
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from istio_agent.config.wasm import WasmSettings
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.httpfetch import HttpFetcher, is_wasm_binary, unwrap
from istio_agent.wasm.ssrf import DialGuard
from tests.http.aioserver import Serve, aio_fixture  # noqa: F401  (the "aio" fixture)
from tests.security.certs import issue, key_to_pem, make_ca, new_key, to_pem

WASM = b"\0asm\x01\0\0\0" + bytes(range(40))
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def fetcher(guard: DialGuard | None = None, **settings: Any) -> HttpFetcher:
    """A fetcher with backoff shortened to milliseconds (as Istio's tests set ``initialBackoff``)."""
    return HttpFetcher(WasmSettings(**settings), guard or DialGuard(), initial_backoff=0.001)


def counting(answer: Callable[[int], web.StreamResponse]) -> tuple[Handler, list[int]]:
    """A handler answering the n-th request (from 0) with ``answer(n)``, and the request count."""
    count = [0]

    async def handle(request: web.Request) -> web.StreamResponse:
        n = count[0]
        count[0] += 1
        response = answer(n)
        if isinstance(response, web.HTTPException):
            raise response  # aiohttp's redirects are raised
        return response

    return handle, count


def tarball(*members: tuple[str, bytes | None]) -> bytes:
    """A POSIX tar of ``(name, content)``; ``None`` content is a directory."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


async def test_download_ok(aio: Serve) -> None:
    handle, count = counting(lambda n: web.Response(body=WASM))
    port = await aio(handle)
    assert await fetcher().fetch(f"http://127.0.0.1:{port}/m.wasm", timeout=5) == WASM
    assert count == [1]


async def test_retries_on_500(aio: Serve) -> None:
    handle, count = counting(lambda n: web.Response(status=500) if n <= 2 else web.Response(body=WASM))
    port = await aio(handle)
    assert await fetcher().fetch(f"http://127.0.0.1:{port}/", timeout=5) == WASM
    assert count == [4]


@pytest.mark.parametrize(
    ("status", "settings", "attempts"),
    [
        pytest.param(500, {}, 5, id="500-retried-5-times"),
        pytest.param(503, {"http_max_retries": 2}, 2, id="max-retries-setting"),
        *(pytest.param(status, {}, 1, id=f"{status}-final") for status in (501, 505, 511, 404, 403)),
    ],
)
async def test_attempts_until_the_last_error(
    aio: Serve, status: int, settings: dict[str, Any], attempts: int
) -> None:
    """Retried on 5xx but 501, 505 and 511, up to WASM_HTTP_REQUEST_MAX_RETRIES attempts (Istio's)."""
    handle, count = counting(lambda n: web.Response(status=status))
    port = await aio(handle)
    with pytest.raises(
        FetchError, match=f"failed after {attempts} attempts, last error: .*status code {status}"
    ):
        await fetcher(**settings).fetch(f"http://127.0.0.1:{port}/", timeout=5)
    assert count == [attempts]


async def test_zero_max_retries_still_tries_once(aio: Serve) -> None:
    """Istio's loop makes no attempt at all with WASM_HTTP_REQUEST_MAX_RETRIES=0; one is the least useful."""
    handle, count = counting(lambda n: web.Response(body=WASM))
    port = await aio(handle)
    assert await fetcher(http_max_retries=0).fetch(f"http://127.0.0.1:{port}/", timeout=5) == WASM
    assert count == [1]


async def test_immediate_timeout_sends_nothing(aio: Serve) -> None:
    handle, count = counting(lambda n: web.Response(status=500))
    port = await aio(handle)
    with pytest.raises(FetchError, match="failed after 1 attempts"):
        await fetcher().fetch(f"http://127.0.0.1:{port}/", timeout=0)
    assert count == [0]


async def test_overall_timeout_stops_the_retries(aio: Serve) -> None:
    """Backoff of 0.5 s would take ~5 s over 5 attempts; the caller's 0.3 s ends it first."""
    handle, count = counting(lambda n: web.Response(status=500))
    port = await aio(handle)
    slow = HttpFetcher(WasmSettings(), DialGuard(), initial_backoff=0.5)
    started = time.monotonic()
    with pytest.raises(FetchError, match=r"timed out|status code 500"):
        await slow.fetch(f"http://127.0.0.1:{port}/", timeout=0.3)
    assert time.monotonic() - started < 1.5
    assert 1 <= count[0] <= 2


async def test_per_attempt_timeout_then_retry(aio: Serve) -> None:
    """A server that hangs on the first request: that attempt times out, the next one succeeds."""
    count = [0]

    async def handle(request: web.Request) -> web.StreamResponse:
        count[0] += 1
        if count[0] == 1:
            await asyncio.sleep(10)
        return web.Response(body=WASM)

    port = await aio(handle)
    quick = fetcher(http_timeout=timedelta(seconds=0.2))
    assert await quick.fetch(f"http://127.0.0.1:{port}/", timeout=5) == WASM
    assert count == [2]


async def test_connection_refused_is_retried_and_reported() -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(FetchError, match=r"after 3 attempts.*127\.0\.0\.1"):
        await fetcher(http_max_retries=3).fetch(f"http://127.0.0.1:{port}/", timeout=5)


async def test_follows_redirects(aio: Serve) -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        hop = int(request.query.get("hop", "0"))
        if hop < 10:
            raise web.HTTPFound(f"/next?hop={hop + 1}")
        return web.Response(body=WASM)

    port = await aio(handle)
    assert await fetcher().fetch(f"http://127.0.0.1:{port}/", timeout=5) == WASM


async def test_stops_after_ten_redirects(aio: Serve) -> None:
    handle, count = counting(lambda n: web.HTTPFound(f"/again{n}"))
    port = await aio(handle)
    with pytest.raises(FetchError, match="10 redirects"):
        await fetcher().fetch(f"http://127.0.0.1:{port}/", timeout=5)
    assert count == [11]  # not retried: the server's answer will not change


async def test_redirect_to_a_blocked_address_is_refused(aio: Serve) -> None:
    """Istio's TestWasmFetchBlocksRedirectToBlockedHost: the redirector is allowed, its target not."""
    target, target_count = counting(lambda n: web.Response(body=b"should never be reached"))
    target_port = await aio(target)
    redirector, _ = counting(lambda n: web.HTTPFound(f"http://127.0.0.2:{target_port}/"))
    port = await aio(redirector)
    guard = DialGuard((ipaddress.ip_network("127.0.0.2/32"),))
    with pytest.raises(FetchError, match=r"blocked.*127\.0\.0\.2"):
        await fetcher(guard).fetch(f"http://127.0.0.1:{port}/", timeout=5)
    assert target_count == [0]


async def test_blocked_address_is_not_retried() -> None:
    started = time.monotonic()
    guard = DialGuard((ipaddress.ip_network("127.0.0.0/8"),))
    slow = HttpFetcher(WasmSettings(), guard, initial_backoff=0.5)
    with pytest.raises(FetchError, match="blocked"):
        await slow.fetch("http://127.0.0.1:9/", timeout=5)
    assert time.monotonic() - started < 0.4


async def test_link_local_refused_without_configuration() -> None:
    with pytest.raises(FetchError, match="link-local"):
        await fetcher().fetch("http://169.254.169.254/latest/meta-data/", timeout=5)


@pytest.fixture(name="tls_server")
def tls_server_fixture(tmp_path: Path) -> ssl.SSLContext:
    """A server context with a certificate for 127.0.0.1 and localhost from a CA nobody trusts."""
    ca_key, ca = make_ca("untrusted")
    key = new_key()
    cert = issue(ca_key, ca, public_key=key.public_key(), dns_sans=["localhost"])
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(to_pem(cert) + to_pem(ca))
    key_path.write_bytes(key_to_pem(key))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    return context


async def test_self_signed_refused_unless_host_is_insecure(aio: Serve, tls_server: ssl.SSLContext) -> None:
    handle, count = counting(lambda n: web.Response(body=WASM))
    port = await aio(handle, ssl_context=tls_server)
    url = f"https://localhost:{port}/m.wasm"
    with pytest.raises(FetchError, match=r"(?i)certificate"):
        await fetcher(http_max_retries=1).fetch(url, timeout=5)
    assert count == [0]
    with pytest.raises(FetchError, match=r"(?i)certificate"):
        await fetcher(http_max_retries=1, insecure_registries=frozenset({"other"})).fetch(url, timeout=5)
    with pytest.raises(FetchError, match=r"(?i)certificate"):  # listed without its port: not this host
        await fetcher(http_max_retries=1, insecure_registries=frozenset({"localhost"})).fetch(url, timeout=5)
    listed = frozenset({f"localhost:{port}"})  # as written in the URL, as Istio compares it
    assert await fetcher(insecure_registries=listed).fetch(url, timeout=5) == WASM
    assert await fetcher(insecure_registries=frozenset({f"localhost:{port}"})).fetch(url, timeout=5) == WASM
    assert await fetcher(insecure_registries=frozenset({"*"})).fetch(url, timeout=5) == WASM
    assert count == [3]


async def test_https_to_http_redirect_refused(aio: Serve, tls_server: ssl.SSLContext) -> None:
    plain, plain_count = counting(lambda n: web.Response(body=WASM))
    plain_port = await aio(plain)
    secure, _ = counting(lambda n: web.HTTPFound(f"http://127.0.0.1:{plain_port}/"))
    port = await aio(secure, ssl_context=tls_server)
    insecure = fetcher(insecure_registries=frozenset({"*"}))
    with pytest.raises(FetchError, match=r"(?i)https.*http"):
        await insecure.fetch(f"https://localhost:{port}/", timeout=5)
    assert plain_count == [0]


async def test_oversize_refused_not_truncated(aio: Serve) -> None:
    handle, _ = counting(lambda n: web.Response(body=WASM))
    port = await aio(handle)
    with pytest.raises(FetchError, match=f"larger than.*{len(WASM) - 1}"):
        await fetcher(max_binary_bytes=len(WASM) - 1).fetch(f"http://127.0.0.1:{port}/", timeout=5)
    assert await fetcher(max_binary_bytes=len(WASM)).fetch(f"http://127.0.0.1:{port}/", timeout=5) == WASM


async def test_oversize_chunked_refused(aio: Serve) -> None:
    """No Content-Length: the limit applies while reading."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(20):
            await response.write(b"x" * 1024)
        await response.write_eof()
        return response

    port = await aio(handle)
    with pytest.raises(FetchError, match="larger than"):
        await fetcher(max_binary_bytes=8 * 1024).fetch(f"http://127.0.0.1:{port}/", timeout=5)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(WASM, id="plain"),
        pytest.param(tarball(("plugin.wasm", WASM)), id="tar"),
        pytest.param(gzip.compress(WASM), id="gzip"),
        pytest.param(gzip.compress(tarball(("plugin.wasm", WASM))), id="gzip-tar"),
        pytest.param(tarball(("dir", None), ("dir/plugin.wasm", WASM)), id="tar-dir-first"),
        pytest.param(gzip.compress(WASM[:10]) + gzip.compress(WASM[10:]), id="gzip-multi-member"),
    ],
)
async def test_unwraps_gzip_and_tar(aio: Serve, body: bytes) -> None:
    handle, _ = counting(lambda n: web.Response(body=body))
    port = await aio(handle)
    assert await fetcher().fetch(f"http://127.0.0.1:{port}/", timeout=5) == WASM


async def test_gzip_bomb_refused(aio: Serve) -> None:
    """64 MiB of zeros in ~64 KiB: refused once past the limit, without inflating it all."""
    bomb = gzip.compress(bytes(64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 1024 * 1024
    handle, _ = counting(lambda n: web.Response(body=bomb))
    port = await aio(handle)
    with pytest.raises(FetchError, match=r"(?i)decompress.*larger than"):
        await fetcher(max_binary_bytes=1024 * 1024).fetch(f"http://127.0.0.1:{port}/", timeout=10)


def test_unwrap_is_best_effort() -> None:
    """What is not a module, a gzip or a tar (or is a broken one) comes back as it was."""
    assert unwrap(b"wasm\n", 1024) == b"wasm\n"
    broken = gzip.compress(WASM)[:-12]
    assert unwrap(broken, 1024) == broken
    empty_tar = tarball(("dir", None))
    assert unwrap(empty_tar, 1024 * 1024) == empty_tar


def test_unwrap_depth_is_bounded() -> None:
    """A gzip that inflates to itself (a quine) would loop forever if unwrapping had no bound
    (Istio's ``unboxIfPossible`` has none); past the bound the body comes back as it was."""
    nested = WASM
    for _ in range(20):
        nested = gzip.compress(nested)
    assert unwrap(nested, 1024 * 1024) == nested
    assert unwrap(gzip.compress(gzip.compress(WASM)), 1024 * 1024) == WASM


def test_is_wasm_binary() -> None:
    assert is_wasm_binary(WASM)
    assert is_wasm_binary(b"\0asm\x01\0\0\0")
    assert not is_wasm_binary(b"\0asm\x01\0\0")
    assert not is_wasm_binary(b"wasm\nxxxx")
