"""Envoy starts as soon as its bootstrap is written, with its SDS and xDS sockets already listening.

The servers behind the sockets start after Envoy; Envoy's connections, queued by the kernel, are
then served. A real Envoy, a fake istiod and a fake CA.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from datetime import timedelta
from pathlib import Path

import pytest

from istio_agent.agent import Agent, AgentSettings
from istio_agent.config import Env, ProxyConfig, XdsSettings
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.ctl.local import free_port
from istio_agent.envoy.process import EnvoyProcess
from istio_agent.host import LocalHost
from istio_agent.metrics import Registry
from istio_agent.security.sds import SdsServer
from istio_agent.xds.proxy import XdsProxy
from tests.test_agent import fake_ca_for, settings_for
from tests.xds import FakeIstiod

pytestmark = pytest.mark.e2e


def connects(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        try:
            client.connect(str(path))
        except OSError:
            return False
    return True


async def test_envoy_starts_on_listening_sockets_before_their_servers_and_is_served(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(short_tmp)  # Envoy finds ./etc/istio/proxy/XDS and the SDS socket from here
    events: list[object] = []
    security = settings_for(short_tmp, CA_ADDR="127.0.0.1:1")
    xds_path = short_tmp / "etc/istio/proxy/XDS"
    original = {"envoy": EnvoyProcess.start, "sds": SdsServer.start, "xds": XdsProxy.start}

    async def envoy_start(self: EnvoyProcess) -> None:
        events.append(("envoy", connects(security.sds_socket_path), connects(xds_path)))
        await original["envoy"](self)

    async def sds_start(self: SdsServer) -> None:
        events.append("sds")
        await original["sds"](self)

    async def xds_start(self: XdsProxy) -> None:
        events.append("xds")
        await original["xds"](self)

    monkeypatch.setattr(EnvoyProcess, "start", envoy_start)
    monkeypatch.setattr(SdsServer, "start", sds_start)
    monkeypatch.setattr(XdsProxy, "start", xds_start)
    istiod = await FakeIstiod().start()
    try:
        xds = XdsSettings(socket_path=xds_path, discovery_address=istiod.address, plaintext=True)
        proxy_config = dataclasses.replace(ProxyConfig(), termination_drain_duration=timedelta(0))
        bootstrap = BootstrapSettings.from_env(
            Env({"POD_NAMESPACE": "ns", "SERVICE_ACCOUNT": "sa", "POD_NAME": "a"}),
            workdir=short_tmp,
            proxy_config=proxy_config,
            security=security,
            host=LocalHost(),
        )
        bootstrap = dataclasses.replace(
            bootstrap,
            proxy_admin_port=free_port(),
            envoy_status_port=free_port(),
            envoy_prometheus_port=free_port(),
        )
        agent = Agent(
            AgentSettings(security=security, proxy_config=proxy_config, xds=xds, bootstrap=bootstrap),
            ca_client=fake_ca_for,
            registry=Registry(),
        )
        await agent.start()
        try:
            assert events == [("envoy", True, True), "sds", "xds"]
            assert agent.xds_proxy is not None
            async with asyncio.timeout(10):  # Envoy's ADS stream, on its queued connection, is relayed
                while agent.xds_proxy.active_streams() == 0:
                    await asyncio.sleep(0.02)
        finally:
            await agent.stop()
    finally:
        await istiod.stop()
