"""Application probe forwarding: ``/app-health/...`` and ``/app-lifecycle/...`` on the status port.

With mTLS (or traffic capture) kubelet cannot probe the application directly, so the injector
points the probes at the agent, which replays the original probe (``ISTIO_KUBE_APP_PROBERS``)
against the pod IP. Probes come from 127.0.0.6 (``::6``), the address Envoy's inbound passthrough
also uses, so the traffic is recognisable and not captured again by the sidecar's iptables rules.
HTTP/1.1 goes through ``istio_agent.http.client``; HTTPS apps that pick h2 via ALPN and gRPC health
checks go through ``h2client``, which (unlike grpcio) lets gRPC probes come from the probe source
address too. Both dial through ``istio_agent.http.dial`` with this module's source-address sockets.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urljoin, urlsplit

from istio_agent.config.probes import AppProber, GRPCCheck, HTTPGetCheck, TCPCheck
from istio_agent.http import dial, h2client
from istio_agent.http.client import URL, Client, ConnectError, HTTPError
from istio_agent.http.headers import Headers
from istio_agent.http.messages import Request, Response
from istio_agent.log import scope

log = scope("healthcheck")

SOURCE_IPV4 = "127.0.0.6"
SOURCE_IPV6 = "::6"
MAX_BODY = 10 * 1024
MAX_REDIRECTS = 10
# Beyond Istio: timeoutSeconds 0 means "no timeout" there, which lets a hung application pin a
# probe (and its socket) forever; we cap every probe at 60 s instead.
MAX_TIMEOUT = 60.0
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
# connect() errors that mean "this source address cannot reach that destination" (e.g. a pod IP
# that is not routed via loopback), as opposed to the application not listening.
_SOURCE_ERRNOS = frozenset({errno.EINVAL, errno.EADDRNOTAVAIL, errno.ENETUNREACH})
# Request headers not copied to the application: the body is never forwarded and the agent
# decides connection reuse itself.
_NOT_COPIED = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
)
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = 1
_T = TypeVar("_T")


class ProbeError(Exception):
    """The probe could not be completed (answered 500)."""


class ProbeSource:
    """Binds probe sockets to 127.0.0.6 / ::6 while that works, without it once it does not."""

    def __init__(self) -> None:
        self._disabled: set[int] = set()

    def active(self, family: int) -> bool:
        return family in (socket.AF_INET, socket.AF_INET6) and family not in self._disabled

    def disable(self, family: int, reason: OSError) -> None:
        if family in self._disabled:
            return
        self._disabled.add(family)
        address = SOURCE_IPV4 if family == socket.AF_INET else SOURCE_IPV6
        log.debug(
            "app probes: source address %s unusable (%s), using the default source", address, reason.strerror
        )

    def open_socket(self, family: int, kind: int = socket.SOCK_STREAM, proto: int = 0) -> socket.socket:
        """A probe socket with SO_LINGER 1 s, bound to the probe source address when usable."""
        sock = socket.socket(family, kind, proto)
        try:
            # As Istio: bounded lingering, so a closed probe connection does not linger for long.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1))
            if self.active(family):
                address = SOURCE_IPV4 if family == socket.AF_INET else SOURCE_IPV6
                try:
                    sock.bind((address, 0))
                except OSError as err:
                    self.disable(family, err)
        except BaseException:
            sock.close()
            raise
        return sock


def _families(host: str) -> list[int]:
    """Address families a destination may resolve to (both for a name)."""
    try:
        return [socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET]
    except ValueError:
        return [socket.AF_INET, socket.AF_INET6]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _timeout(prober: AppProber) -> float:
    seconds = prober.timeout_seconds
    return MAX_TIMEOUT if seconds <= 0 else min(float(seconds), MAX_TIMEOUT)


def encode_health_request(service: str) -> bytes:
    """``HealthCheckRequest{string service = 1}`` in protobuf wire format."""
    data = service.encode()
    if not data:
        return b""
    return b"\x0a" + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ProbeError("malformed health check response")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def decode_health_status(data: bytes) -> int:
    """``HealthCheckResponse.status`` (field 1, enum) from protobuf wire format; 0 when absent."""
    status = 0
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if number == 1:
                status = value
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ProbeError("malformed health check response")
        if pos > len(data):
            raise ProbeError("malformed health check response")
    return status


class AppProbes:
    """The status server's handler for ``/app-health/...`` and ``/app-lifecycle/...`` paths.

    ``pod_ip`` is where probes go (INSTANCE_IP, or ``localhost`` with
    REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION); the prober's own ``host`` is ignored, as in Istio.
    """

    def __init__(
        self,
        probers: dict[str, AppProber],
        *,
        pod_ip: str,
        status_port: int,
        keepalive: bool = False,
        http2: bool = True,
    ) -> None:
        self._probers = dict(probers)
        self._pod_ip = pod_ip
        self._status_port = status_port
        self._keepalive = keepalive
        self._http2 = http2  # ISTIO_ENABLE_HTTP2_PROBING: offer h2 to HTTPS apps
        self._source = ProbeSource()
        self._tls_alpn = _probe_tls(["h2", "http/1.1"])
        self._h1 = Client(  # connections pooled only with keep-alive
            tls=_probe_tls(["http/1.1"]), socket_factory=self._source.open_socket, keepalive=keepalive
        )

    async def close(self) -> None:
        """Close pooled connections (only pooled with keep-alive)."""
        await self._h1.aclose()

    async def handle(self, request: Request) -> Response:
        prober = self._probers.get(request.path)
        if prober is None:
            return Response(400, text=f"app prober config does not exists for {request.path}")
        action = prober.check
        try:
            async with asyncio.timeout(_timeout(prober)) as deadline:
                if isinstance(action, HTTPGetCheck):
                    return await self._http_get(request, action)
                if isinstance(action, TCPCheck):
                    await self._tcp(action)
                    return Response(200)
                await self._grpc(request, action, deadline)
                return Response(200)
        except TimeoutError:
            log.info("app probe %s timed out after %ss", request.path, _timeout(prober))
        except h2client.GrpcError as err:
            if err.code == h2client.UNIMPLEMENTED:
                log.info(
                    "app probe %s failed: server does not implement the grpc health protocol "
                    "(grpc.health.v1.Health): %s",
                    request.path,
                    err,
                )
            else:
                log.info("app probe %s failed: grpc probe failed: %s", request.path, err)
        except (ProbeError, OSError, HTTPError, h2client.H2Error, ValueError) as err:
            log.info("app probe %s failed: %s", request.path, err or type(err).__name__)
        return Response(500)

    async def _from_source(self, host: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Run a dialling ``attempt``; again from the default source if the probe source cannot
        reach ``host`` (a pod IP not routed via loopback), remembering that for later probes."""
        families = _families(host)
        try:
            return await attempt()
        except (OSError, ConnectError) as err:
            cause = err.os_error if isinstance(err, ConnectError) else err
            if (
                isinstance(cause, ssl.SSLError)
                or cause.errno not in _SOURCE_ERRNOS
                or not any(self._source.active(f) for f in families)
            ):
                raise
            for family in families:
                self._source.disable(family, cause)
        return await attempt()

    def _dial(
        self, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> Awaitable[h2client.Connection]:
        return h2client.open_connection(host, port, tls=tls, socket_factory=self._source.open_socket)

    # --- httpGet ---------------------------------------------------------------------------------

    def _host_header(self, request: Request, app_port: int) -> str | None:
        """Incoming Host, with the status port replaced by the application port."""
        host = request.headers.get("Host")
        if not host:
            return None
        name, sep, port = host.rpartition(":")
        if sep and not name.endswith("]") and ":" in name:
            return host  # bare IPv6 literal without a port
        if sep and port == str(self._status_port):
            return f"{name}:{app_port}"
        return host

    async def _http_get(self, request: Request, prober: HTTPGetCheck) -> Response:
        scheme = "https" if prober.https else "http"
        path = prober.path if prober.path.startswith("/") else "/" + prober.path
        origin = URL.parse(f"{scheme}://{_url_host(self._pod_ip)}:{prober.port}{path}")
        headers = Headers()
        for name, value in request.headers.items():
            if name.lower() not in _NOT_COPIED:
                headers.add(name, value)
        if not self._keepalive:
            headers["Connection"] = "close"
        host = self._host_header(request, prober.port)
        url = origin
        for hop in range(MAX_REDIRECTS + 1):
            sent = headers.copy()
            if host:
                sent["Host"] = host
            status, location, body = await self._fetch(url, sent)
            if status in _REDIRECT_CODES and location is not None:
                try:
                    joined = urljoin(str(url), location)
                    if urlsplit(joined).hostname != origin.host:
                        return Response(200)  # another host: the 3xx itself is the answer
                    target = URL.parse(joined)
                except (ValueError, HTTPError) as err:
                    raise ProbeError(f"bad redirect location: {err}") from None
                if hop == MAX_REDIRECTS:
                    raise ProbeError(f"stopped after {MAX_REDIRECTS} redirects")
                if urlsplit(location).netloc:
                    host = None  # Host follows an absolute redirect; kept for a relative one
                url = target
                continue
            if 300 <= status < 400:
                return Response(200)
            return Response(status, body=body)
        raise ProbeError("unreachable")  # pragma: no cover

    async def _fetch(self, url: URL, headers: Headers) -> tuple[int, str | None, bytes]:
        """One GET; over HTTP/2 when an HTTPS app picks h2, else HTTP/1.1."""
        if url.scheme == "https" and self._http2:
            answer = await self._from_source(url.host, lambda: self._fetch_h2(url, headers))
            if answer is not None:
                return answer
        return await self._from_source(url.host, lambda: self._fetch_h1(url, headers))

    async def _fetch_h2(self, url: URL, headers: Headers) -> tuple[int, str | None, bytes] | None:
        """GET over HTTP/2 if the app picks h2 via ALPN; ``None`` when it picks HTTP/1.1.

        The HTTP/1.1 answer then comes over a second connection, the HTTP/1.1 client's own.
        """
        async with await self._dial(url.host, url.port, self._tls_alpn) as conn:
            protocol = conn.alpn
            if protocol is None or protocol == "http/1.1":
                return None
            if protocol != "h2":
                raise ProbeError(f"unsupported ALPN protocol {protocol!r}")
            authority = headers.get("Host") or f"{_url_host(url.host)}:{url.port}"
            response = await conn.request(
                "GET", url.target, authority=authority, headers=headers.items(), max_body=MAX_BODY
            )
        body = b"" if 300 <= response.status < 400 else response.body
        return response.status, response.header("location"), body

    async def _fetch_h1(self, url: URL, headers: Headers) -> tuple[int, str | None, bytes]:
        async with self._h1.stream("GET", url, headers=headers) as response:
            body = b""
            if not (300 <= response.status < 400):
                body = await response.read(MAX_BODY, truncate=True)
            return response.status, response.headers.get("Location"), body

    # --- tcpSocket -------------------------------------------------------------------------------

    async def _tcp(self, prober: TCPCheck) -> None:
        sock = await self._from_source(
            self._pod_ip, lambda: dial.connect(self._pod_ip, prober.port, self._source.open_socket)
        )
        sock.close()

    # --- grpc ------------------------------------------------------------------------------------

    async def _grpc(self, request: Request, prober: GRPCCheck, deadline: asyncio.Timeout) -> None:
        """``grpc.health.v1.Health/Check`` over plaintext HTTP/2; only SERVING passes."""
        conn = await self._from_source(self._pod_ip, lambda: self._dial(self._pod_ip, prober.port))
        when = deadline.when()
        remaining = None if when is None else max(0.0, when - asyncio.get_running_loop().time())
        async with conn:
            response = await h2client.grpc_unary(
                conn,
                _HEALTH_CHECK,
                encode_health_request(prober.service),
                authority=f"{_url_host(self._pod_ip)}:{prober.port}",
                user_agent=request.headers.get("User-Agent"),
                timeout=remaining,
            )
        status = decode_health_status(response)
        if status != _SERVING:
            raise ProbeError(f"gRPC health status {status}")


def _probe_tls(alpn: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # as kubelet: probes do not verify certificates
    context.set_alpn_protocols(alpn)
    return context
