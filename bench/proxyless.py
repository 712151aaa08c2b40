"""Proxyless and operator-tool benchmarks.

    python -m bench.proxyless [--agents 50] [--runs 10]

``proxy_status_via_agents``: ``agentctl proxy-status --xds-via-agents`` across N agents, each asked
concurrently through its debug tap. Every agent here is the real xDS proxy and debug tap
(``XdsProxy`` + ``DebugTap``) with a gRPC client standing in for Envoy on its socket, all relaying
to one local control plane (plaintext) in this process; so the figure includes every hop the
question takes (tap, the workload's upstream stream, the control plane's syncz over N proxies, and
back), with all N agents sharing one event loop and core, which real agents (a process each) do not.
Measured: wall time of one proxy-status (p50 and max over ``--runs``), and that all N proxies are
listed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from istio_agent.cli.runtime import prepare_process

prepare_process()  # before grpc loads: its C-core lines stay quiet, as in every command

import grpc  # noqa: E402
from envoy.config.core.v3.base_pb2 import Node  # noqa: E402
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2  # noqa: E402

from istio_agent.config import XdsSettings  # noqa: E402
from istio_agent.controlplane.server import ControlPlane  # noqa: E402
from istio_agent.controlplane.xdsgen import CLUSTER_TYPE  # noqa: E402
from istio_agent.ctl import proxystatus as ps  # noqa: E402
from istio_agent.metrics import Registry  # noqa: E402
from istio_agent.xds import XdsProxy  # noqa: E402
from istio_agent.xds.tap import DebugTap  # noqa: E402


async def _agent(
    stack: AsyncExitStack, base: Path, index: int, discovery: str
) -> tuple[ps.Agent, asyncio.Task[None]]:
    """One agent's xDS proxy and tap, and an Envoy-like client that subscribed to CDS and ACKs."""
    settings = XdsSettings(
        socket_path=base / f"a{index}" / "XDS", discovery_address=discovery, plaintext=True
    )
    proxy = XdsProxy(settings, registry=Registry())
    await proxy.start()
    stack.push_async_callback(proxy.stop)
    tap = DebugTap(proxy, 0, host="127.0.0.1")
    await tap.start()
    stack.push_async_callback(tap.stop)
    channel = grpc.aio.insecure_channel(f"unix:{settings.socket_path}")
    stack.push_async_callback(channel.close)
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
    node = Node(id=f"sidecar~127.0.0.1~w{index}.default~default.svc.cluster.local")
    await call.write(discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE, node=node))

    async def envoy() -> None:
        async for response in call:
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=response.type_url,
                    response_nonce=response.nonce,
                    version_info=response.version_info,
                )
            )

    task = asyncio.create_task(envoy())
    return ps.Agent(f"127.0.0.1:{tap.port}", f"w{index}.default"), task


async def proxy_status_via_agents(count: int = 50, runs: int = 10) -> dict[str, float]:
    """p50 and max seconds of one proxy-status through ``count`` agents (all must be listed)."""
    with tempfile.TemporaryDirectory(prefix="ia-ps-") as tmp:
        base = Path(tmp)
        mesh = base / "mesh.yaml"
        mesh.write_text(
            "trustDomain: cluster.local\nservices:\n- {name: b, namespace: default, port: 8000}\n"
        )
        plane = ControlPlane(mesh, base / "state", "127.0.0.1:0", "127.0.0.1:0")
        await plane.start()
        async with AsyncExitStack() as stack:
            stack.push_async_callback(plane.stop, 0)
            made = [await _agent(stack, base, i, f"127.0.0.1:{plane.port}") for i in range(count)]
            agents = [agent for agent, _ in made]
            for _, task in made:
                stack.callback(task.cancel)
            node = ps.debug_node("istio-system", "default")
            listed = 0
            deadline = time.monotonic() + 30
            while listed < count and time.monotonic() < deadline:  # every proxy connected and ACKed
                result = await ps.via_agents(agents[:1], node, limit=0)
                listed = len(ps.proxies(result.responses))
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                result = await ps.via_agents(agents, node, limit=0, timeout=10)
                times.append(time.perf_counter() - started)
                rows = ps.proxies(result.responses)
                if result.failures or len(rows) != count:
                    raise RuntimeError(f"listed {len(rows)} of {count}; failures: {result.failures[:3]}")
        return {"p50": statistics.median(times), "max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    figures = asyncio.run(proxy_status_via_agents(args.agents, args.runs))
    print(
        f"proxy-status via {args.agents} agents (concurrent, one process): "
        f"p50 {figures['p50'] * 1000:.0f} ms, max {figures['max'] * 1000:.0f} ms over {args.runs} runs"
    )


if __name__ == "__main__":
    main()
