"""Channels to istiod that failed stop dialling: once the agent has recovered, none reconnects in the background.

The scenario of the field report: the root certificate on disk is wrong (a re-issued CA, a bad
config map), every connection fails its TLS handshake, then the right root comes back and the next
connection works. A channel that failed, even one a lingering reference keeps alive after
``close()``, must not go on reconnecting with the old root. A counting relay in front of the
control plane's TLS port sees every dial; gc is paused so a channel is never freed by luck.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import Node

from istio_agent.config import XdsSettings
from istio_agent.controlplane.server import ControlPlane
from istio_agent.controlplane.tokens import mint_token
from istio_agent.istiod.dial import IstiodEndpoint
from istio_agent.istiod.tokens import FileTokenSource
from istio_agent.metrics import Registry
from istio_agent.security.caclient import CAError, CitadelClient
from tests.controlplane import make_key, spiffe_csr, started_plane
from tests.security.certs import make_ca, to_pem
from tests.tcp_relay import CountingRelay
from tests.xds import CDS, EnvoyStream, running

ISTIOD = "istiod.istio-system.svc"
NODE = Node(id="sidecar~127.0.0.1~app-1.default~default.svc.cluster.local")
FAILED_STREAMS = 4
SETTLE = 1.5
"""After recovery: long enough for what a failed channel may still be doing to end."""
WINDOW = 4.0
"""How long the relay watches for stale dials: several of gRPC's reconnect backoffs (1 s, 1.6 s, ...)."""


@pytest.fixture
def gc_paused() -> Iterator[None]:
    """No collection during the test: a channel lives as long as something refers to it."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with started_plane(tmp_path) as cp:
        yield cp


@pytest.fixture
async def relay(plane: ControlPlane) -> AsyncIterator[CountingRelay]:
    counting = await CountingRelay(plane.secure_port).start()
    try:
        yield counting
    finally:
        await counting.stop()


def agent_files(directory: Path, plane: ControlPlane) -> tuple[Path, Path]:
    """A root certificate file holding the wrong CA, and a token the control plane accepts."""
    root = directory / "root-cert.pem"
    root.write_bytes(to_pem(make_ca("not the control plane's CA")[1]))
    token = directory / "istio-token"
    token.write_text(mint_token(plane.root_cert_path.parent, "default", "app-1"))
    return root, token


async def dials_after_recovery(relay: CountingRelay) -> int:
    await asyncio.sleep(SETTLE)
    before = relay.accepted
    await asyncio.sleep(WINDOW)
    return relay.accepted - before


async def test_failed_xds_upstreams_stop_dialling(
    short_tmp: Path, plane: ControlPlane, relay: CountingRelay, gc_paused: None
) -> None:
    root, token = agent_files(short_tmp, plane)
    settings = XdsSettings(
        socket_path=short_tmp / "XDS",
        discovery_address=relay.address,
        root_ca=root,
        server_name=ISTIOD,
        token_path=token,
    )
    async with running(settings) as (_, channel):
        for _ in range(FAILED_STREAMS):  # Envoy retrying while the root is wrong
            failing = EnvoyStream(channel)
            await failing.send(CDS, node=NODE)
            code, details = await failing.status()
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert "CERTIFICATE_VERIFY_FAILED" in details
        root.write_bytes(plane.root_cert_path.read_bytes())
        envoy = EnvoyStream(channel)
        await envoy.send(CDS, node=NODE)
        assert (await envoy.recv()).type_url == CDS  # recovered: one stream, one connection
        assert await dials_after_recovery(relay) == 0
        await envoy.close()


async def test_failed_ca_connections_stop_dialling(
    tmp_path: Path, plane: ControlPlane, relay: CountingRelay, gc_paused: None
) -> None:
    root, token = agent_files(tmp_path, plane)
    endpoint = IstiodEndpoint(
        purpose="CA", address=relay.address, plaintext=False, root_cert=root, server_name=ISTIOD
    )
    client = CitadelClient(endpoint, FileTokenSource(token), registry=Registry())
    csr = spiffe_csr(make_key(), "spiffe://cluster.local/ns/default/sa/app-1")
    try:
        with pytest.raises(CAError, match="CERTIFICATE_VERIFY_FAILED"):  # every retry fails its handshake
            await client.csr_sign(csr, timedelta(hours=1))
        root.write_bytes(plane.root_cert_path.read_bytes())
        assert len(await client.csr_sign(csr, timedelta(hours=1))) >= 2
        assert await dials_after_recovery(relay) == 0
    finally:
        await client.close()
