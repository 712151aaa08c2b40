"""Keepalive pings as Istio's clients send them keep an idle stream up on every gRPC server of ours.

The agent pings istiod every GRPC_KEEPALIVE_INTERVAL (30 s); istiod accepts pings down to half its
own interval. A server with gRPC's default policy (one ping per 5 minutes without data) answers
the third early ping with GOAWAY ``too_many_pings`` and every stream on the connection ends. The
intervals here are half a second so that ten of them pass in five seconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import Node

from istio_agent import keepalive
from istio_agent.config import XdsSettings
from istio_agent.controlplane.server import ControlPlane
from istio_agent.controlplane.xdsgen import CLUSTER_TYPE, LISTENER_TYPE
from tests.controlplane import started_plane
from tests.xds import EnvoyStream, running

INTERVAL = timedelta(milliseconds=500)
TIMEOUT = timedelta(seconds=5)
IDLE = 5.0
"""Ten keepalive intervals: a server that refuses the pings has reset the stream long before."""
NODE = Node(id="sidecar~127.0.0.1~app-1.default~default.svc.cluster.local")


def test_server_accepts_pings_down_to_half_its_interval() -> None:
    assert keepalive.min_client_ping_interval(30.0) == 15.0


def grpcio_client_pings(interval: timedelta, timeout: timedelta) -> list[tuple[str, int]]:
    """A grpcio client's keepalive options (C-core's channel argument names)."""
    return [
        ("grpc.keepalive_time_ms", int(interval.total_seconds() * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout.total_seconds() * 1000)),
    ]


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with started_plane(tmp_path, keepalive_interval=INTERVAL, keepalive_timeout=TIMEOUT) as cp:
        yield cp


def settings_for(workdir: Path, plane: ControlPlane) -> XdsSettings:
    """The agent's xDS proxy to the control plane's plaintext port, pinging it every INTERVAL."""
    return XdsSettings(
        socket_path=workdir / "XDS",
        discovery_address=f"127.0.0.1:{plane.port}",
        plaintext=True,
        keepalive_interval=INTERVAL,
        keepalive_timeout=TIMEOUT,
    )


async def stays_up(channel: grpc.aio.Channel) -> None:
    """An ADS stream answered, left idle for IDLE seconds, and still answering."""
    envoy = EnvoyStream(channel)
    await envoy.send(CLUSTER_TYPE, node=NODE)
    assert (await envoy.recv()).type_url == CLUSTER_TYPE
    await envoy.expect_silence(IDLE)  # a reset would arrive here as the stream's error
    await envoy.send(LISTENER_TYPE)
    assert (await envoy.recv()).type_url == LISTENER_TYPE
    await envoy.close()


async def test_control_plane_keeps_an_idle_stream_the_agent_pings(
    short_tmp: Path, plane: ControlPlane
) -> None:
    async with running(settings_for(short_tmp, plane)) as (_, channel):
        await stays_up(channel)


async def test_xds_proxy_keeps_an_idle_stream_its_client_pings(short_tmp: Path, plane: ControlPlane) -> None:
    """A client of the agent's xDS socket (Envoy with connection_keepalive, a proxyless gRPC app)."""
    envoy_pings = grpcio_client_pings(INTERVAL, TIMEOUT)
    async with running(settings_for(short_tmp, plane), channel_options=envoy_pings) as (_, channel):
        await stays_up(channel)
