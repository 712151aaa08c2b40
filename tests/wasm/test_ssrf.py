"""The SSRF guard every Wasm fetch dials through: which addresses are refused, and the OCI realm rules.

Cases from Istio's ``pkg/wasm/ssrf_test.go``, ``pkg/security/dial_test.go`` and
``pkg/wasm/imagefetcher_test.go`` (``TestValidateAllRealms``), at the mirror's HEAD.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator

import pytest

from istio_agent.wasm import metrics
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.ssrf import DialGuard, check_bearer_realm, open_guarded_stream


@pytest.mark.parametrize(
    "ip",
    [
        "169.254.169.254",  # cloud metadata endpoint
        "169.254.0.1",
        "fe80::1",
        "fe80::1%1",  # with a zone, as getaddrinfo reports link-local IPv6
        "100.100.100.200",  # Alibaba Cloud metadata
        "fd00:ec2::230",  # AWS IMDS IPv6
        "fd00:ec2::1",
        "224.0.0.251",  # link-local multicast
        "ff02::1",
        "::ffff:169.254.169.254",  # IPv4-mapped IPv6: the IPv4 address it is
        "::ffff:100.100.100.200",
    ],
)
def test_blocked_by_default(ip: str) -> None:
    with pytest.raises(FetchError) as caught:
        DialGuard().check(ip)
    assert ip.split("%")[0] in str(caught.value) or "169.254" in str(caught.value)
    assert caught.value.reason == metrics.DOWNLOAD_FAILURE


@pytest.mark.parametrize(
    "ip",
    [
        "10.0.0.1",  # in-cluster hosting is legitimate (Istio allows private ranges)
        "172.16.0.1",
        "192.168.1.1",
        "127.0.0.1",
        "::1",
        "8.8.8.8",
        "100.100.100.199",  # just outside Alibaba's /32
        "fd12:3456::1",  # ULA, not AWS's prefix
        "::ffff:10.0.0.1",
    ],
)
def test_allowed_by_default(ip: str) -> None:
    DialGuard().check(ip)


def test_configured_ranges_are_blocked() -> None:
    guard = DialGuard((ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32")))
    for ip in ("10.1.2.3", "::ffff:10.1.2.3", "2001:db8::5"):
        with pytest.raises(FetchError, match=r"10\.0\.0\.0/8|2001:db8::/32"):
            guard.check(ip)
    guard.check("192.168.1.1")
    guard.check("2001:db9::1")


def test_not_an_address_is_refused() -> None:
    with pytest.raises(FetchError):
        DialGuard().check("metadata.google.internal")


@contextlib.asynccontextmanager
async def _listener(host: str) -> AsyncIterator[int]:
    """A TCP server on ``host`` that answers every connection with ``hello``; yields its port."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_open_guarded_stream_connects_to_an_allowed_address() -> None:
    async with _listener("127.0.0.1") as port:
        stream = await open_guarded_stream("127.0.0.1", port, tls=None, guard=DialGuard())
        try:
            assert await stream.reader.read() == b"hello"
        finally:
            await stream.close()


async def test_open_guarded_stream_refuses_a_blocked_literal() -> None:
    async with _listener("127.0.0.1") as port:
        guard = DialGuard((ipaddress.ip_network("127.0.0.0/8"),))
        with pytest.raises(FetchError, match=r"127\.0\.0\.1 .*127\.0\.0\.0/8"):
            await open_guarded_stream("127.0.0.1", port, tls=None, guard=guard)


async def test_open_guarded_stream_names_an_ipv6_host_in_brackets() -> None:
    guard = DialGuard((ipaddress.ip_network("::1/128"),))
    with pytest.raises(FetchError, match=r"^\[::1\]:9: connection blocked"):
        await open_guarded_stream("::1", 9, tls=None, guard=guard)


async def test_open_guarded_stream_refuses_a_name_resolving_to_a_blocked_address() -> None:
    """The check is on what the name resolves to, not on the name (``localhost`` is not in any list)."""
    async with _listener("127.0.0.1") as port:
        guard = DialGuard((ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")))
        with pytest.raises(FetchError, match="localhost"):
            await open_guarded_stream("localhost", port, tls=None, guard=guard)


async def test_open_guarded_stream_skips_blocked_addresses_for_allowed_ones() -> None:
    """A name with a blocked and an allowed address is dialled on the allowed one only (as Go's dialer)."""
    infos = socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)
    families = {info[0] for info in infos}
    if families != {socket.AF_INET, socket.AF_INET6}:
        pytest.skip("localhost does not resolve to both 127.0.0.1 and ::1 here")
    async with _listener("127.0.0.1") as port:
        guard = DialGuard((ipaddress.ip_network("::1/128"),))
        stream = await open_guarded_stream("localhost", port, tls=None, guard=guard)
        try:
            assert stream.peer[0] == "127.0.0.1"
        finally:
            await stream.close()


async def test_blocked_addresses_of_a_name_are_never_dialled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name whose first answer is blocked and second allowed: only the allowed one is connected to.

    The resolver's answer is fixed here (no name resolves that way on a test machine); the sockets are real.
    """
    loop = asyncio.get_running_loop()
    async with _listener("127.0.0.1") as port, _listener("127.0.0.2") as blocked_port:
        answers: list[tuple[object, ...]] = [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", blocked_port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

        async def resolve(host: str, wanted: int, **_: object) -> list[tuple[object, ...]]:
            assert host == "registry.test"
            return answers

        monkeypatch.setattr(loop, "getaddrinfo", resolve)
        guard = DialGuard((ipaddress.ip_network("127.0.0.2/32"),))
        stream = await open_guarded_stream("registry.test", port, tls=None, guard=guard)
        try:
            assert stream.peer == ("127.0.0.1", port)
        finally:
            await stream.close()
        answers.pop()
        with pytest.raises(FetchError, match=r"^registry\.test:\d+: .*127\.0\.0\.2"):
            await open_guarded_stream("registry.test", port, tls=None, guard=guard)


async def test_open_guarded_stream_connection_refused_is_an_oserror() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(OSError):
        await open_guarded_stream("127.0.0.1", port, tls=None, guard=DialGuard())


@pytest.mark.parametrize(
    "realm",
    ["https://auth.example.com/token", "http://auth.example.com/token", "https://AUTH.example.com:5001/t"],
)
def test_safe_realms(realm: str) -> None:
    check_bearer_realm(realm)


@pytest.mark.parametrize(
    "realm",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://169.254.1.1/foo",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://METADATA.google.internal./computeMetadata/v1/",  # case and a trailing dot: same host
        "http://localhost:8080/admin",
        "http://Localhost./admin",
        "http://127.0.0.1/api",
        "http://127.0.0.5/api",
        "file:///etc/passwd",
        "gopher://internal:9000/_GET",
        "dict://redis:6379/INFO",
        "http://10.0.0.1/token",
        "http://192.168.1.1/token",
        "http://172.16.0.1/token",
        "http://[::1]/token",
        "http://[fe80::1]/token",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://[fc00::1]/token",
        "http://[::ffff:127.0.0.1]/token",
        "http://100.100.100.200/latest",
        "http://0.0.0.0:8080/token",  # the unspecified address connects to this host
        "http:///token",
        "not a url",
    ],
)
def test_malicious_realms(realm: str) -> None:
    with pytest.raises(FetchError, match="realm"):
        check_bearer_realm(realm)
