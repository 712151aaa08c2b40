"""The ``httpGet`` check: one GET (and its redirects) against the application, from the probe source.

HTTP/1.1 goes over ``istio_agent.http.client``. With ``http2`` an HTTPS app is offered ``h2`` via
ALPN and, when it picks it, asked over ``istio_agent.http.h2client`` (Istio's
``ISTIO_ENABLE_HTTP2_PROBING``); an app that picks HTTP/1.1 is asked again over the HTTP/1.1 client.
Certificates are not verified, as kubelet and Istio do not verify them for probes.

The two callers differ only in what they ask for: kubelet's probes stop at a redirect to another
host (its answer is the probe's answer), VM checks follow every redirect as Go's ``http.Client``
does; both stop after 10 and keep the ``Host`` header across relative redirects only.
"""

from __future__ import annotations

import enum
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from istio_agent.http.client import URL, Client, ConnectError, HTTPError
from istio_agent.http.dial import Stream, open_stream
from istio_agent.http.headers import Headers
from istio_agent.probe.source import ProbeSource

MAX_REDIRECTS = 10
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})


class Redirects(enum.Enum):
    """Which redirects a GET follows."""

    FOLLOW = "follow"
    """Every one (Go's ``http.Client``, VM health checks)."""
    SAME_HOST = "same-host"
    """Those to the same host; a redirect elsewhere is the answer (kubelet's prober)."""


@dataclass(frozen=True)
class HTTPAnswer:
    """The final response: its status and up to ``max_body`` bytes of its body (none for a 3xx)."""

    status: int
    body: bytes = b""


class HTTPGetProber:
    """GETs from the probe source; with ``keepalive`` HTTP/1.1 connections are reused."""

    def __init__(self, source: ProbeSource, *, keepalive: bool = False, http2: bool = False) -> None:
        self._source = source
        self._tls_h1 = _unverified(["http/1.1"])
        self._tls_h2 = _unverified(["h2", "http/1.1"]) if http2 else None
        self._h1 = Client(connector=self._connect_h1, keepalive=keepalive)

    async def aclose(self) -> None:
        """Close pooled connections (only pooled with keep-alive)."""
        await self._h1.aclose()

    async def get(self, url: URL, headers: Headers, *, redirects: Redirects, max_body: int = 0) -> HTTPAnswer:
        """GET ``url`` with ``headers`` (a ``Host`` among them overrides the URL's), following redirects.

        Raises ``ConnectError`` when the app cannot be reached, another ``HTTPError`` for a broken
        exchange, too many redirects or a bad ``Location``, ``h2client.H2Error`` for a broken HTTP/2
        exchange; the caller bounds the time with ``asyncio.timeout``.
        """
        fields = headers.copy()
        host = fields.pop("Host")
        origin = url.host
        for hop in range(MAX_REDIRECTS + 1):
            sent = Headers([("Host", host)] if host else None)
            for name, value in fields.items():
                sent.add(name, value)
            status, location, body = await self._fetch(url, sent, max_body)
            if status not in REDIRECT_CODES or location is None:
                return HTTPAnswer(status, body)
            try:
                joined = urljoin(str(url), location)
                if redirects is Redirects.SAME_HOST and urlsplit(joined).hostname != origin:
                    return HTTPAnswer(status)
                target = URL.parse(joined)
            except (ValueError, HTTPError) as err:
                raise HTTPError(f"bad redirect location: {err}") from None
            if hop == MAX_REDIRECTS:
                raise HTTPError(f"stopped after {MAX_REDIRECTS} redirects")
            if urlsplit(location).netloc:
                host = None  # Host follows an absolute redirect; it is kept for a relative one
            url = target
        raise AssertionError("unreachable")  # pragma: no cover

    async def _fetch(self, url: URL, headers: Headers, max_body: int) -> tuple[int, str | None, bytes]:
        """One GET: over HTTP/2 when an HTTPS app picks h2, else HTTP/1.1."""
        if url.scheme == "https" and self._tls_h2 is not None:
            answer = await self._fetch_h2(url, headers, max_body, self._tls_h2)
            if answer is not None:
                return answer
        async with self._h1.stream("GET", url, headers=headers) as response:
            body = b""
            if max_body > 0 and not 300 <= response.status < 400:
                body = await response.read(max_body, truncate=True)
            return response.status, response.headers.get("Location"), body

    async def _connect_h1(self, url: URL) -> Stream:
        """The HTTP/1.1 client's connector: dial from the probe source."""
        tls = self._tls_h1 if url.scheme == "https" else None
        try:
            return await self._source.dial(
                url.host,
                lambda: open_stream(url.host, url.port, tls=tls, socket_factory=self._source.open_socket),
            )
        except OSError as err:  # refused, unreachable, no such host, TLS handshake
            raise ConnectError(url.address, err) from None

    async def _fetch_h2(
        self, url: URL, headers: Headers, max_body: int, tls: ssl.SSLContext
    ) -> tuple[int, str | None, bytes] | None:
        """GET over HTTP/2 if the app picks h2 via ALPN; ``None`` when it picks HTTP/1.1.

        The HTTP/1.1 answer then comes over a second connection, the HTTP/1.1 client's own.
        """
        from istio_agent.http import h2client  # only HTTPS app probes need HTTP/2

        connection = await self._source.dial(
            url.host,
            lambda: h2client.open_connection(
                url.host, url.port, tls=tls, socket_factory=self._source.open_socket
            ),
        )
        async with connection:
            protocol = connection.alpn
            if protocol is None or protocol == "http/1.1":
                return None
            if protocol != "h2":
                raise HTTPError(f"unsupported ALPN protocol {protocol!r}")
            response = await connection.request(
                "GET",
                url.target,
                authority=headers.get("Host") or url.address,
                headers=headers.items(),
                max_body=max_body,
            )
        body = b"" if 300 <= response.status < 400 else response.body
        return response.status, response.header("location"), body


def _unverified(alpn: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # as kubelet and Istio: probes do not verify certificates
    context.set_alpn_protocols(alpn)
    return context
