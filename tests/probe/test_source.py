"""The probe source address: 127.0.0.6 while it reaches the destination, the default source after."""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
import struct

import pytest

from istio_agent.probe.source import SOURCE_IPV4, ProbeSource


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (OSError(errno.EINVAL, "Invalid argument"), True),
        (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), True),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), True),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), False),
        (ssl.SSLError(errno.EINVAL, "handshake"), False),
    ],
)
async def test_unreachable_from_source_retries_from_default(error: OSError, retried: bool) -> None:
    # A pod IP that 127.0.0.6 cannot reach (not routed via loopback) cannot be set up on loopback,
    # so the dial fails the way the kernel would.
    source = ProbeSource()
    calls: list[bool] = []

    async def attempt() -> str:
        calls.append(source.active(socket.AF_INET))
        if len(calls) == 1:
            raise error
        return "connected"

    if retried:
        assert await source.dial("10.1.2.3", attempt) == "connected"
        assert calls == [True, False]  # second try from the default source, which sticks
        assert not source.active(socket.AF_INET)
    else:
        with pytest.raises(OSError):
            await source.dial("10.1.2.3", attempt)
        assert calls == [True]
        assert source.active(socket.AF_INET)


async def test_a_name_gives_up_the_source_for_both_families() -> None:
    source = ProbeSource()
    attempts = 0

    async def attempt() -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise OSError(errno.ENETUNREACH, "Network is unreachable")

    await source.dial("app.example", attempt)
    assert not source.active(socket.AF_INET) and not source.active(socket.AF_INET6)


async def test_probe_sockets_come_from_127_0_0_6_and_linger_briefly() -> None:
    peers: list[str] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[0])
        writer.close()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        with ProbeSource().open_socket(socket.AF_INET) as sock:
            assert sock.getsockname()[0] == SOURCE_IPV4
            assert struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)) == (1, 1)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        async with asyncio.timeout(5):
            while not peers:
                await asyncio.sleep(0.01)
        assert peers == [SOURCE_IPV4]
    finally:
        server.close()
        await server.wait_closed()


def test_an_unusable_source_is_left_unbound() -> None:
    # ::6 is not a local address on this host: the bind fails once, later sockets do not try it.
    source = ProbeSource()
    with source.open_socket(socket.AF_INET6) as sock:
        assert sock.getsockname()[0] == "::"
    assert not source.active(socket.AF_INET6)
    assert source.active(socket.AF_INET)
