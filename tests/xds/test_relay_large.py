"""A push larger than gRPC's default 4 MiB through the xDS proxy, both flavours (issue 23).

Istio's agent opens its upstream stream with ``grpc.MaxCallRecvMsgSize(math.MaxInt32)``
(pkg/istio-agent/xds_proxy.go, ``defaultClientMaxReceiveMessageSize``): a mesh's push may be tens
of megabytes. Envoy's own client has no 4 MiB limit either; grpcio, standing in for it here, is told so.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from istio_agent.rpc import message
from istio_agent.xds.relay import UPSTREAM_MAX_RECEIVE_BYTES
from tests.xds import CDS, EnvoyStream, FakeIstiod, running
from tests.xds.test_proxy import NODE, settings_for

MiB = 1024 * 1024
ENVOY = [("grpc.max_receive_message_length", 64 * MiB)]


def test_the_upstream_accepts_what_istios_agent_accepts() -> None:
    assert UPSTREAM_MAX_RECEIVE_BYTES == 2**31 - 1  # math.MaxInt32


def clusters(total_bytes: int) -> list[any_pb2.Any]:
    """Clusters with long names adding up to about ``total_bytes``."""
    resources = []
    for index in range(total_bytes // (64 * 1024) + 1):
        resource = any_pb2.Any()
        resource.Pack(cluster_pb2.Cluster(name=f"c{index}-" + "x" * (64 * 1024)))
        resources.append(resource)
    return resources


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
async def test_a_push_over_four_mebibytes_reaches_envoy_whole(short_tmp: Path, delta: bool) -> None:
    istiod = await FakeIstiod().start()
    try:
        async with running(settings_for(short_tmp, istiod.address), channel_options=ENVOY) as (_, channel):
            envoy = EnvoyStream(channel, delta=delta)
            await envoy.send(CDS, node=NODE)
            upstream = await istiod.next_stream()
            await upstream.recv()
            resources = clusters(6 * MiB)
            if delta:
                push: object = discovery_pb2.DeltaDiscoveryResponse(
                    type_url=CDS,
                    nonce="big",
                    resources=[
                        discovery_pb2.Resource(name=f"r{i}", resource=r) for i, r in enumerate(resources)
                    ],
                )
            else:
                push = discovery_pb2.DiscoveryResponse(type_url=CDS, nonce="big", resources=resources)
            assert push.ByteSize() > 6 * MiB  # type: ignore[attr-defined]
            await upstream.send(push)
            assert await envoy.recv() == push
            await envoy.close()
    finally:
        await istiod.stop()


async def test_a_relayed_push_is_let_go_before_the_next_is_received(short_tmp: Path) -> None:
    """SotW pushes come back to back (CDS, then EDS): a relay still holding the push it has written
    while it receives the next holds two."""
    istiod = await FakeIstiod().start()
    try:
        async with running(settings_for(short_tmp, istiod.address), channel_options=ENVOY) as (_, channel):
            envoy = EnvoyStream(channel)
            await envoy.send(CDS, node=NODE)
            upstream = await istiod.next_stream()
            await upstream.recv()
            push = discovery_pb2.DiscoveryResponse(type_url=CDS, nonce="big", resources=clusters(2 * MiB))
            tracemalloc.start()
            try:
                await upstream.send(push)
                assert await envoy.recv() == push
                await asyncio.sleep(0.2)  # the relay is waiting for istiod's next response
                held = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, message.__file__)])
            finally:
                tracemalloc.stop()
            still = sum(stat.size for stat in held.statistics("filename"))
            assert still < MiB, f"{still / MiB:.1f} MiB of received messages still held"
            await envoy.close()
    finally:
        await istiod.stop()
