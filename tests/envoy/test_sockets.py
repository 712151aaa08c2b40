"""Envoy's SDS and xDS sockets listen before their servers serve; the servers take them over."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import grpc
import pytest

from istio_agent.config import XdsSettings
from istio_agent.envoy import sockets
from istio_agent.metrics import Registry
from istio_agent.security.sds import SdsServer
from istio_agent.xds.proxy import XdsProxy
from tests.security.test_sds import FakeSecretProvider


def connects(path: Path) -> bool:
    """True when a plain Unix-socket connect to ``path`` succeeds (the kernel queues it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        try:
            client.connect(str(path))
        except OSError:
            return False
    return True


async def test_a_listener_takes_connections_before_any_server_serves(short_tmp: Path) -> None:
    path = short_tmp / "var/run/secrets/workload-spiffe-uds/socket"
    path.parent.mkdir(parents=True)
    path.write_text("left behind")  # a stale file is replaced, as when a server binds
    listener = await sockets.listen_sds(path)
    try:
        assert connects(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666  # Envoy may run as another user
    finally:
        await listener.close()
    assert not connects(path)


async def test_a_refused_bind_names_the_server_and_the_reason(short_tmp: Path) -> None:
    blocker = short_tmp / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"SDS server could not listen on .*file/socket: .*Not a directory"):
        await sockets.listen_sds(blocker / "socket")


async def test_the_sds_server_answers_a_client_that_connected_before_it_started(short_tmp: Path) -> None:
    path = short_tmp / "sds"
    listener = await sockets.listen_sds(path)
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        ready = asyncio.ensure_future(channel.channel_ready())
        await asyncio.sleep(0.2)  # the client's connection waits in the socket's queue
        assert not ready.done()
        server = SdsServer(FakeSecretProvider(), Path("/unused"), listener=listener, registry=Registry())
        assert server.socket_path == path
        await server.start()
        try:
            await asyncio.wait_for(ready, 5)
            fetch = channel.unary_unary("/envoy.service.secret.v3.SecretDiscoveryService/FetchSecrets")
            assert await asyncio.wait_for(fetch(b""), 5) is not None  # served, not UNIMPLEMENTED
        finally:
            await server.stop()
    await listener.close()  # after the server stopped: nothing left to do


async def test_the_xds_proxy_serves_a_client_that_connected_before_it_started(short_tmp: Path) -> None:
    settings = XdsSettings(socket_path=short_tmp / "XDS", discovery_address="127.0.0.1:1", plaintext=True)
    listener = await sockets.listen_xds(settings)
    async with grpc.aio.insecure_channel(f"unix:{settings.socket_path}") as channel:
        ready = asyncio.ensure_future(channel.channel_ready())
        await asyncio.sleep(0.2)
        assert not ready.done()
        proxy = XdsProxy(settings, listener=listener, registry=Registry())
        await proxy.start()
        try:
            await asyncio.wait_for(ready, 5)
        finally:
            await proxy.stop()
    assert not connects(settings.socket_path)
