"""The guarded client every Wasm fetch (HTTP module and OCI registry) makes its requests with.

Against real local servers (aiohttp): redirects and their limits, the per-hop TLS decision, the
Authorization kept to the origin. That every hop is dialled through the SSRF guard is pinned where
it matters, through both fetchers (``test_httpfetch``, ``test_oci``: a redirect to a blocked address).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from istio_agent.http.client import URL, BodyTooLarge, ConnectError
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.guarded import MAX_REDIRECTS, GuardedClient
from istio_agent.wasm.ssrf import DialGuard
from tests.http.aioserver import Serve, aio_fixture  # noqa: F401  (the "aio" fixture)
from tests.http.h2server import tls_server_context

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def recording(answer: Callable[[web.Request], web.StreamResponse]) -> tuple[Handler, list[web.Request]]:
    """A handler answering with ``answer(request)`` (raised when it is a redirect), and its requests."""
    seen: list[web.Request] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        response = answer(request)
        if isinstance(response, web.HTTPException):
            raise response
        return response

    return handle, seen


async def get(client: GuardedClient, url: str, **options: object) -> tuple[int, bytes]:
    try:
        async with client.send("GET", URL.parse(url), **options) as response:  # type: ignore[arg-type]
            return response.status, await response.read()
    finally:
        await client.aclose()


async def test_follows_redirects_to_the_final_answer(aio: Serve) -> None:
    final, _ = recording(lambda r: web.Response(body=b"module"))
    final_port = await aio(final)
    hop, _ = recording(lambda r: web.HTTPFound(f"http://127.0.0.1:{final_port}/m"))
    port = await aio(hop)
    assert await get(GuardedClient(DialGuard()), f"http://127.0.0.1:{port}/") == (200, b"module")


async def test_stops_after_the_redirect_limit(aio: Serve) -> None:
    handle, seen = recording(lambda r: web.HTTPFound(f"/again{len(r.path)}"))
    port = await aio(handle)
    with pytest.raises(FetchError, match=f"stopped after {MAX_REDIRECTS} redirects"):
        await get(GuardedClient(DialGuard()), f"http://127.0.0.1:{port}/")
    assert len(seen) == MAX_REDIRECTS + 1


async def test_a_post_redirect_is_the_answer(aio: Serve) -> None:
    handle, seen = recording(lambda r: web.HTTPFound("/elsewhere"))
    port = await aio(handle)
    client = GuardedClient(DialGuard())
    async with client.send("POST", URL.parse(f"http://127.0.0.1:{port}/token"), body=b"x") as response:
        assert response.status == 302
    await client.aclose()
    assert [r.path for r in seen] == ["/token"]


async def test_authorization_goes_to_the_origin_only(aio: Serve) -> None:
    """Another port on the same host is another origin: the redirect there carries no credentials."""
    other, other_seen = recording(lambda r: web.Response(body=b"blob"))
    other_port = await aio(other)

    def answer(request: web.Request) -> web.StreamResponse:
        if request.path == "/first":
            return web.HTTPFound("/second")  # same origin: keeps it
        return web.HTTPFound(f"http://127.0.0.1:{other_port}/blob")

    origin, origin_seen = recording(answer)
    port = await aio(origin)
    client = GuardedClient(DialGuard())
    assert await get(client, f"http://127.0.0.1:{port}/first", authorization="Bearer secret") == (
        200,
        b"blob",
    )
    assert [r.headers.get("Authorization") for r in origin_seen] == ["Bearer secret", "Bearer secret"]
    assert "Authorization" not in other_seen[0].headers


async def test_headers_go_to_every_hop(aio: Serve) -> None:
    other, other_seen = recording(lambda r: web.Response(body=b"x"))
    other_port = await aio(other)
    origin, _ = recording(lambda r: web.HTTPFound(f"http://127.0.0.1:{other_port}/"))
    port = await aio(origin)
    await get(GuardedClient(DialGuard()), f"http://127.0.0.1:{port}/", headers={"Accept": "a/b"})
    assert other_seen[0].headers["Accept"] == "a/b"


async def test_https_to_plain_http_redirect_is_refused(aio: Serve, tmp_path: Path) -> None:
    plain, plain_seen = recording(lambda r: web.Response(body=b"x"))
    plain_port = await aio(plain)
    secure, _ = recording(lambda r: web.HTTPFound(f"http://127.0.0.1:{plain_port}/"))
    port = await aio(secure, ssl_context=tls_server_context(tmp_path, None))
    client = GuardedClient(DialGuard(), skip_verify=lambda url: True)
    with pytest.raises(FetchError, match=r"from https .* to plain http"):
        await get(client, f"https://127.0.0.1:{port}/")
    assert plain_seen == []


async def test_tls_verification_is_decided_per_hop(aio: Serve, tmp_path: Path) -> None:
    """The first host is trusted to skip verification, the one it redirects to is not."""
    tls = tls_server_context(tmp_path, None)
    second, second_seen = recording(lambda r: web.Response(body=b"x"))
    second_port = await aio(second, ssl_context=tls)
    first, first_seen = recording(lambda r: web.HTTPFound(f"https://localhost:{second_port}/"))
    first_port = await aio(first, ssl_context=tls)
    asked: list[str] = []

    def skip_verify(url: URL) -> bool:
        asked.append(url.authority)
        return url.host == "127.0.0.1"

    client = GuardedClient(DialGuard(), skip_verify=skip_verify)
    with pytest.raises(ConnectError) as caught:
        await get(client, f"https://127.0.0.1:{first_port}/")
    assert isinstance(caught.value.os_error, ssl.SSLCertVerificationError)
    assert asked == [f"127.0.0.1:{first_port}", f"localhost:{second_port}"]
    assert len(first_seen) == 1 and second_seen == []


async def test_a_bad_location_is_a_fetch_error(aio: Serve) -> None:
    handle, _ = recording(lambda r: web.Response(status=302, headers={"Location": "http://[bad/"}))
    port = await aio(handle)
    with pytest.raises(FetchError, match="bad redirect location"):
        await get(GuardedClient(DialGuard()), f"http://127.0.0.1:{port}/")


async def test_keepalive_reuses_the_connection(aio: Serve) -> None:
    peers: list[object] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(body=b"x")

    port = await aio(handle)
    client = GuardedClient(DialGuard(), keepalive=True)
    for _ in range(2):
        async with client.send("GET", URL.parse(f"http://127.0.0.1:{port}/")) as response:
            await response.read()
    await client.aclose()
    assert len(peers) == 2 and peers[0] == peers[1]


async def test_fetch_caps_a_200_and_cuts_an_error_body(aio: Serve) -> None:
    """A 200's body is what was asked for (refused past its cap); an error's is only read for its message."""

    def answer(request: web.Request) -> web.StreamResponse:
        status = 200 if request.path == "/ok" else 404
        return web.Response(status=status, body=b"y" * 100)

    handle, _ = recording(answer)
    port = await aio(handle)
    client = GuardedClient(DialGuard())
    fetched = await client.fetch("GET", URL.parse(f"http://127.0.0.1:{port}/ok"), max_body=100)
    assert (fetched.status, fetched.body) == (200, b"y" * 100)
    with pytest.raises(BodyTooLarge):
        await client.fetch("GET", URL.parse(f"http://127.0.0.1:{port}/ok"), max_body=99)
    missing = await client.fetch(
        "GET", URL.parse(f"http://127.0.0.1:{port}/no"), max_body=1000, max_error_body=10
    )
    assert (missing.status, missing.body, missing.truncated) == (404, b"y" * 10, True)
    await client.aclose()
