"""The one HTTP client of Wasm fetches: every connection through the SSRF guard, redirects followed safely.

Both fetchers (a module at an http(s) URL, an image from an OCI registry with its token realm and blob
storage) get their modules from places mesh config names, so they share the rules here rather than
each keeping its own: every hop is dialled through :func:`istio_agent.wasm.ssrf.open_guarded_stream`;
TLS is verified unless the caller's predicate says that hop's host may skip it (decided per hop, so
an insecure registry does not make the storage it redirects to unverified); a redirect from https
down to plain http is refused; at most ``MAX_REDIRECTS`` are followed (Go's client stops there too);
an ``Authorization`` is sent to the origin the request started at only, never to a host it is
redirected to.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from istio_agent.http.client import URL, Client, ClientResponse, ConnectError, HTTPError
from istio_agent.http.dial import Stream
from istio_agent.http.exchange import Fetched, default_tls
from istio_agent.http.headers import Headers
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.ssrf import DialGuard, open_guarded_stream

MAX_REDIRECTS = 10
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
MAX_ERROR_BYTES = 64 << 10
"""What is read of an answer other than 200: enough for a registry's JSON error."""
FOLLOWED_METHODS = frozenset({"GET", "HEAD"})
"""Methods whose redirects are followed; any other gets the redirect as its answer."""

SkipVerify = Callable[[URL], bool]
"""Whether the TLS certificate of the host ``URL`` names may go unchecked (insecure registries)."""


def _verify_all(url: URL) -> bool:
    return False


class GuardedClient:
    """Requests for one fetch; ``keepalive`` pools connections across them (close with ``aclose``)."""

    def __init__(
        self, guard: DialGuard, *, skip_verify: SkipVerify = _verify_all, keepalive: bool = False
    ) -> None:
        # The connector holds the guard and the predicate, not this object: a bound method would make
        # a cycle through the client, keeping its last connection and buffers (a whole module) until
        # the cyclic GC ran.
        self._client = Client(connector=functools.partial(_connect, guard, skip_verify), keepalive=keepalive)

    @asynccontextmanager
    async def send(
        self,
        method: str,
        url: URL,
        *,
        headers: Mapping[str, str] | None = None,
        authorization: str | None = None,
        body: bytes = b"",
    ) -> AsyncIterator[ClientResponse]:
        """The final response to ``method url`` (redirects of GET and HEAD followed), open for reading.

        ``headers`` go with every hop; ``authorization`` only to ``url``'s origin. ``FetchError`` for a
        refused hop (a blocked address, https to http, a bad ``Location``, too many redirects);
        ``HTTPError`` (``ConnectError``, ``ProtocolError``) as the client raises them.
        """
        origin = _origin(url)
        for hop in range(MAX_REDIRECTS + 1):
            fields = Headers(headers)
            if authorization is not None and _origin(url) == origin:
                fields["Authorization"] = authorization
            async with self._client.stream(method, url, headers=fields, body=body) as response:
                location = response.headers.get("Location")
                if method not in FOLLOWED_METHODS or response.status not in REDIRECT_CODES or not location:
                    yield response
                    return
            following = follow(url, location)
            if hop == MAX_REDIRECTS:
                raise FetchError(f"{method} {url}: stopped after {MAX_REDIRECTS} redirects")
            url = following
        raise AssertionError("unreachable")  # pragma: no cover

    async def fetch(
        self,
        method: str,
        url: URL,
        *,
        max_body: int,
        max_error_body: int = MAX_ERROR_BYTES,
        headers: Mapping[str, str] | None = None,
        authorization: str | None = None,
        body: bytes = b"",
    ) -> Fetched:
        """The whole final response of :meth:`send`: a 200's body up to ``max_body`` (``BodyTooLarge``
        past it), any other's cut at ``max_error_body`` (it is read for the error it reports only)."""
        async with self.send(
            method, url, headers=headers, authorization=authorization, body=body
        ) as response:
            if response.status == 200:
                content = await response.read(max_body)
            else:
                content = await response.read(max_error_body, truncate=True)
        return Fetched(response.status, response.reason, response.headers, content, response.truncated)

    async def aclose(self) -> None:
        """Close the kept-alive connections (a later request opens new ones)."""
        await self._client.aclose()


async def _connect(guard: DialGuard, skip_verify: SkipVerify, url: URL) -> Stream:
    """The client's connector: through the guard, TLS verified unless ``skip_verify(url)``."""
    tls = None
    if url.scheme == "https":
        tls = unverified_tls() if skip_verify(url) else default_tls()
    try:
        return await open_guarded_stream(url.host, url.port, tls=tls, guard=guard)
    except OSError as err:  # refused, unreachable, no such host, TLS handshake
        raise ConnectError(url.address, err) from None


def follow(url: URL, location: str) -> URL:
    """A redirect's target; ``FetchError`` for a ``Location`` that is no URL or goes from https to http."""
    try:
        following = url.join(location)
    except (HTTPError, ValueError) as err:
        raise FetchError(f"bad redirect location {location!r}: {err}") from None
    if url.scheme == "https" and following.scheme == "http":
        raise FetchError(f"refusing the redirect from https ({url}) to plain http ({following})")
    return following


_UNVERIFIED: ssl.SSLContext | None = None


def unverified_tls() -> ssl.SSLContext:
    """No certificate check: only for hosts the operator listed in ``WASM_INSECURE_REGISTRIES``."""
    global _UNVERIFIED
    if _UNVERIFIED is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        _UNVERIFIED = context
    return _UNVERIFIED


def _origin(url: URL) -> tuple[str, str, int]:
    return (url.scheme, url.host, url.port)
